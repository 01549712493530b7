"""`maxtext-moe doctor`: what a recipe needs against what this machine has, one line each.

Nothing upstream answers "can this recipe run here?" before the expensive part: MaxText learns
that TE is missing when it imports it mid-setup, that the GPU has no MXFP8 when XLA compiles, and
that NCCL is too old for TE's NCCL EP when the first all-to-all launches; TE picks its grouped
GEMM path from its compile-time cuBLAS version and fails at run time on an older library
(shared/device/README.md). This module probes the machine without building anything (library
versions through ctypes and package metadata; jax is imported, TE only when installed) and
compares it with the resolved recipe. Every gap carries its fix; any gap makes the exit status 1.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import xla_flags
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.recipe.validate import FP8_QUANTIZATIONS, MXFP8
from maxtext_moe.run import distributed
from maxtext_moe.tools.library_versions import (
    call_version,
    dist_version,
    loaded_nccl_code,
    nccl_ep_lib_path,
    nccl_version,
)
from maxtext_moe.upstream import deviceless, fa3_attention

GPU_FIX = "run it on a GPU machine with jax[cuda13]==0.11.2 (pip install '.[gpu]'), or choose a CPU recipe"
NCCL_EP_MIN = (2, 30, 4)  # what TE 2.20.2's ep_dispatch/ep_combine need
FP8_MIN_CC = (8, 9)
MXFP8_MIN_CC = (10, 0)
NCCL_EP_MIN_CC = (9, 0)
TE_FIX = (
    "install Transformer Engine's JAX bindings: pip install '.[gpu]' (transformer-engine[jax]==2.20.2), "
    "or use the container (docs/CLUSTER.md)"
)


@dataclass(frozen=True)
class Machine:
    """What this process can see; plain data so that tests can describe other machines."""

    jax_version: str
    backend: str
    device_kind: str
    local_devices: int
    compute_capability: tuple[int, int] | None
    te_version: str | None
    te_error: str | None  # why `transformer_engine.jax` did not import; None when it did (or is absent)
    te_compiled_v2: bool | None
    cublaslt: int | None  # runtime cuBLASLt version, e.g. 130100
    nccl: tuple[int, int, int] | None  # the libnccl.so.2 TE's NCCL EP binds (see `loaded_nccl_code`)
    host_mem_gib: float
    nccl_ep_lib: str | None = None  # TE's libnccl_ep.so, None when TE (or the library) is absent
    cuda_plugin: bool = False  # JAX's CUDA plugin is installed: `plan --compile` can compile for GPUs without one
    fa3: str | None = None  # FlashAttention-3's build for MLA (attention.kernel: fa3), None when absent


@dataclass(frozen=True)
class Line:
    item: str
    have: str
    status: str  # "ok", "info" or "gap"
    fix: str = ""


def probe() -> Machine:
    """Look at this machine; jax must see the recipe's environment already (see `run`)."""
    import jax

    devices = jax.local_devices()
    d = devices[0]
    cc = getattr(d, "compute_capability", None)
    te_version = dist_version(
        "transformer_engine_jax", "transformer-engine-jax", "transformer_engine", "transformer-engine"
    )
    te_error = compiled_v2 = cublaslt = None
    if importlib.util.find_spec("transformer_engine") is not None:
        try:  # after jax.devices(): the CUDA plugin has loaded the cuBLAS TE binds to (device/README.md)
            from maxtext_moe.upstream import te

            cublaslt = te.runtime_cublaslt()
            compiled_v2 = te.v2_grouped_gemm_compiled()
        except Exception as e:  # noqa: BLE001 - any import failure is the finding
            te_error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    if cublaslt is None:
        cublaslt = call_version("libcublasLt", "cublasLtGetVersion", by_pointer=False)
    nccl = loaded_nccl_code()
    return Machine(
        jax_version=jax.__version__,
        backend=jax.default_backend(),
        device_kind=d.device_kind,
        local_devices=len(devices),
        compute_capability=tuple(int(x) for x in str(cc).split(".")[:2]) if cc else None,
        te_version=te_version,
        te_error=te_error,
        te_compiled_v2=compiled_v2,
        cublaslt=cublaslt,
        nccl=nccl_version(nccl) if nccl else None,
        host_mem_gib=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        nccl_ep_lib=nccl_ep_lib_path(),
        cuda_plugin=deviceless.available(),
        fa3=fa3_attention.build_info(),
    )


def _sm(cc: tuple[int, int] | None) -> str:
    return f"SM{cc[0]}{cc[1]}" if cc else "no compute capability"


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def te_reasons(r: ResolvedRecipe) -> list[str]:
    """The recipe keys that make it need Transformer Engine."""
    reasons = [
        f"{k}={r.effective(k)}"
        for k in ("quantization", "te_gmm_quantization")
        if str(r.effective(k) or "").startswith("te_") and (k == "quantization" or r.effective("te_moe_block"))
    ]
    if r.effective("te_moe_block"):
        reasons.insert(0, "te_moe_block=true")
    if r.effective("attention") == "cudnn_flash_te":
        reasons.append("attention=cudnn_flash_te")
    if r.moe_settings.ours and r.moe_settings.gemm == "te":  # our MoE layer's grouped GEMMs (maxtext_moe/moe/gemm.py)
        reasons.append("moe.gemm=te")
    return reasons


def require_gpu(r: ResolvedRecipe) -> None:
    """Refuse a GPU recipe where jax has no GPU, before anything is written.

    Only jax's backend is asked (no TE import, no library probe): without it a GPU recipe fails later with a
    TE hint that never names the missing GPU, or trains MaxText's MoE on the CPU until memory runs out.
    """
    import jax

    hw = r.topology.profile
    backend = jax.default_backend()
    if hw.maxtext_hardware == "gpu" and backend != "gpu":
        raise UserError(
            f"this recipe runs on {hw.name} GPUs; jax sees none here (backend {backend}).",
            key="topology.hardware",
            source=r.sources.get("topology.hardware", r.name),
            fix=f"{GPU_FIX} (`maxtext-moe doctor {r.name}` lists what this machine lacks).",
        )


def compare(m: Machine, r: ResolvedRecipe) -> list[Line]:
    """One line per fact; a `gap` line for each requirement of `r` this machine does not meet."""
    t, hw = r.topology, r.topology.profile
    gpu = hw.maxtext_hardware == "gpu"
    on_gpu = m.backend == "gpu"
    lines = [
        Line(
            "jax",
            f"{m.jax_version}, backend {m.backend}",
            "ok" if on_gpu or not gpu else "gap",
            "" if on_gpu or not gpu else f"the recipe runs on {hw.name} GPUs (topology.hardware); {GPU_FIX}",
        )
    ]
    gpu_have = f"{m.device_kind}, {_sm(m.compute_capability)}" if on_gpu else "none (no CUDA device visible to jax)"
    need_cc = max(
        [hw.compute_capability or (0, 0)]
        + [FP8_MIN_CC] * (str(r.effective("quantization") or "") in FP8_QUANTIZATIONS)
        + [MXFP8_MIN_CC] * (MXFP8 in (str(r.effective("quantization")), str(r.effective("te_gmm_quantization"))))
        + [MXFP8_MIN_CC] * (r.moe_settings.fp8 == "mxfp8")
    )
    cc_short = gpu and on_gpu and (m.compute_capability or (0, 0)) < need_cc
    if gpu:
        gpu_have += f"; recipe needs {_sm(need_cc)}+ ({hw.name}, quantization keys)"
    lines.append(
        Line(
            "gpu",
            gpu_have,
            "gap" if cc_short else ("ok" if on_gpu else "info"),
            f"the recipe needs {_sm(need_cc)} or newer ({hw.name}, quantization keys); run it on such GPUs "
            "or drop the FP8/MXFP8 fragment"
            if cc_short
            else "",
        )
    )
    per_process = t.gpus_per_node
    comparable = on_gpu or not gpu  # a GPU recipe's device count means nothing on a CPU backend
    short = comparable and m.local_devices < per_process
    lines.append(
        Line(
            "devices",
            f"{m.local_devices} local {m.device_kind} device(s); recipe wants {per_process} per node "
            f"x {t.nodes} node(s)",
            "gap" if short else ("ok" if comparable else "info"),
            f"set topology.gpus_per_node={m.local_devices} (and the ici_*_parallelism sizes), or run where "
            f"{per_process} devices are visible (CUDA_VISIBLE_DEVICES)"
            if short
            else "",
        )
    )
    needs_te = te_reasons(r)
    te_ok = m.te_version is not None and m.te_error is None
    te_have = (
        "not installed"
        if m.te_version is None
        else f"{m.te_version}, JAX extension "
        + ("imports" if m.te_error is None else f"fails to import ({m.te_error})")
    )
    lines.append(
        Line(
            "transformer-engine",
            te_have + (f"; needed by {', '.join(needs_te)}" if needs_te else ""),
            "gap" if needs_te and not te_ok else ("ok" if te_ok else "info"),
            TE_FIX if needs_te and not te_ok else "",
        )
    )
    if m.cublaslt is not None and m.te_error is None and m.te_version is not None:
        from maxtext_moe.moe.gemm import TE_V2_MIN_CUBLASLT, te_grouped_gemm_path  # the rule training applies

        requested = r.moe_settings.te_gemm_path
        have = (
            f"cuBLASLt {m.cublaslt}, TE built with V2: {m.te_compiled_v2}; V2 needs >= {TE_V2_MIN_CUBLASLT} on Hopper"
        )
        try:
            path = te_grouped_gemm_path(m.cublaslt, bool(m.te_compiled_v2), requested)
            lines.append(
                Line(
                    "te grouped gemm", f"{'V2 single-kernel' if path == 'v2' else 'V1 per-group'} path ({have})", "info"
                )
            )
        except UserError:
            lines.append(
                Line(
                    "te grouped gemm",
                    f"moe.te_gemm_path={requested} cannot run here ({have})",
                    "gap",
                    "set moe.te_gemm_path=auto (or v1), or use an image with cuBLAS >= 13.4",
                )
            )
    lines.append(_nccl_line(m, r, te_ok))
    if gpu:
        lines.append(_fa3_line(m, r))
    if gpu:
        lines.append(_compile_line(m, r))
    lines.append(Line("host memory", f"{m.host_mem_gib:.0f} GiB", "info"))
    return lines


def _fa3_line(m: Machine, r: ResolvedRecipe) -> Line:
    """Whether FlashAttention-3 for MLA is installed, and whether the recipe runs it (attention.kernel: fa3)."""
    needed = r.attention["kernel"] == "fa3"
    have = (m.fa3 or "not installed") + ("; needed by attention.kernel=fa3" if needed else "")
    if needed and m.fa3 is None:
        return Line(
            "flashattention-3",
            have,
            "gap",
            f"build it with {fa3_attention.BUILD} and put the unpacked folder on PYTHONPATH, "
            "or set attention.kernel=cudnn",
        )
    return Line("flashattention-3", have, "ok" if needed else "info")


def _compile_line(m: Machine, r: ResolvedRecipe) -> Line:
    """Which compiler `plan RECIPE --compile` would give its figures from on this machine, by `compile_route`'s rule."""
    from maxtext_moe.plan import compile_route

    gpus = m.local_devices if m.backend == "gpu" else 0
    try:
        route = compile_route.choose_route(r, gpus, deviceless_ok=not gpus and m.cuda_plugin)
    except UserError as e:
        return Line("plan --compile", f"refused here ({e.key})", "info", e.fix or "")
    have = {
        "gpu": "XLA:GPU on a mock topology of this machine's GPUs",
        "gpu-aot": f"XLA:GPU for {r.topology.num_devices} {r.topology.profile.name} GPUs without them (deviceless)",
        "cpu": "XLA:CPU stand-in, not a GPU's buffers (pip install '.[gpu]' for XLA:GPU's without a GPU)",
    }[route.name]
    return Line("plan --compile", have, "info")


def _nccl_line(m: Machine, r: ResolvedRecipe, te_ok: bool) -> Line:
    """Whether NCCL EP can run here (TE's JAX bindings, its libnccl_ep.so, libnccl.so.2 >= 2.30.4, SM90+), and
    whether the recipe needs it: MaxText's TE block with expert parallelism, or our block with nccl_ep."""
    ep = int(r.effective("ici_expert_parallelism"))
    users = ["te_moe_block with expert parallelism"] * (bool(r.effective("te_moe_block")) and (ep == -1 or ep > 1))
    users += ["moe.exchange=nccl_ep"] * (r.moe_settings.ours and r.moe_settings.exchange == "nccl_ep")
    missing = [
        *(["TE's JAX bindings"] if not te_ok else []),
        *(["TE's libnccl_ep.so"] if te_ok and m.nccl_ep_lib is None else []),
        *([f"libnccl.so.2 >= {_dotted(NCCL_EP_MIN)}"] if m.nccl is None or m.nccl < NCCL_EP_MIN else []),
        *(["SM90+"] if (m.compute_capability or (0, 0)) < NCCL_EP_MIN_CC else []),
    ]
    have = (_dotted(m.nccl) if m.nccl else "libnccl.so.2 not found") + (
        "; NCCL EP usable" if not missing else f"; NCCL EP not usable (lacks {', '.join(missing)})"
    )
    gap = bool(users) and bool(missing)
    return Line(
        "nccl",
        have + (f"; needed by {' and '.join(users)}" if users else ""),
        "gap" if gap else "info",
        f"use TE 2.20.2 with NCCL >= {_dotted(NCCL_EP_MIN)} on SM90+ GPUs (the container, or the NCCL carry of "
        "docs/PERFORMANCE.md), or set moe.exchange=auto / te_moe_block=false"
        if gap
        else "",
    )


def render(r: ResolvedRecipe, lines: list[Line]) -> str:
    width = max(len(x.item) for x in lines)
    out = [
        f"{'GAP' if x.status == 'gap' else x.status:<4} {x.item.ljust(width)}  {x.have}"
        + (f". Fix: {x.fix}." if x.fix else "")
        for x in lines
    ]
    gaps = sum(x.status == "gap" for x in lines)
    out.append(f"{r.name}: " + (f"cannot run here ({gaps} gap(s) above)" if gaps else "can run here"))
    return "\n".join(out)


def run(
    r: ResolvedRecipe,
    *,
    as_json: bool = False,
    out: Callable[[str], None] = print,
    probe_fn: Callable[[], Machine] = probe,
) -> int:
    """Print the report; 0 when the recipe can run here, 1 when it cannot."""
    xla_flags.check(r)  # before the probe starts jax with the recipe's flags: XLA would abort it
    os.environ.update(r.env)  # what training would see: JAX_PLATFORMS, device count, memory fraction
    os.environ.update(distributed.process_env(r.topology, os.environ))
    machine = probe_fn()
    lines = compare(machine, r)
    ok = not any(x.status == "gap" for x in lines)
    if as_json:
        report: dict[str, Any] = {
            "recipe": r.name,
            "can_run": ok,
            "machine": asdict(machine),
            "checks": [asdict(x) for x in lines],
        }
        out(json.dumps(report, indent=2))
    else:
        out(render(r, lines))
    return 0 if ok else 1
