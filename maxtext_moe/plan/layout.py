"""How a recipe lays the model out on a cluster: mesh, batch, dtypes, remat policy, MoE path.

MaxText derives these inside its pydantic model and mesh code at launch; the planner needs them as
plain numbers, and `--gpus/--gpu-type` and `--search` need to vary them without rewriting YAML.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from maxtext_moe.errors import UserError
from maxtext_moe.moe.remat_names import up_output_placement
from maxtext_moe.recipe.composition import suggest
from maxtext_moe.recipe.hardware import PROFILES, Hardware, profile
from maxtext_moe.recipe.resolved import ResolvedRecipe

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
# JAX preallocates this fraction of HBM when XLA_PYTHON_CLIENT_MEM_FRACTION is unset.
JAX_DEFAULT_MEM_FRACTION = 0.75

# Tensors MaxText's custom remat policy can name (configs/base.yml, maxtext 0.2.5) that a DeepSeek
# decoder produces; each is 'device' (saved in HBM), 'offload' (saved in host memory) or 'remat'.
REMAT_TENSORS = (
    "context",
    "mlpwi_0",
    "mlpwi_1",
    "mlpwo",
    "moe_mlpwi_0",
    "moe_mlpwi_1",
    "moe_mlpwo",
    "moe_x_sorted",
    "query_proj",
    "key_proj",
    "value_proj",
    "out_proj",
    "query_wa_proj",
    "kv_wa_proj",
    "mla_q",
    "mla_kv",
    "attention_out",
)
# Named presets, written as the custom policy they amount to for these tensors.
_QKV = ("query_proj", "key_proj", "value_proj")
# MaxText's `minimal` saves these names (its NNXDecoder.minimal_policy); the expert GEMM outputs carry
# mlpwi_0 / mlpwi_1 / mlpwo in our block (MaxText's sparse_matmul leaves mlpwi_1 off wi_1, so for its
# block the plan counts one [rows, moe_mlp] tensor too many). Attention's context, the MLA latents and
# the permuted expert input are recomputed.
_MINIMAL = _QKV + ("out_proj", "mlpwi_0", "mlpwi_1", "mlpwo", "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
REMAT_PRESETS: dict[str, dict[str, str]] = {
    "full": {},
    "minimal": {t: "device" for t in _MINIMAL},
    "minimal_with_context": {t: "device" for t in _MINIMAL + ("context",)},
    "minimal_offloaded": {t: "offload" for t in _MINIMAL},
    "save_qkv_proj": {t: "device" for t in _QKV},
    "qkv_proj_offloaded": {t: "offload" for t in _QKV},
    "save_out_proj": {"out_proj": "device"},
}


@dataclass(frozen=True)
class Layout:
    """One placement of the model: what `plan` evaluates and `--search` varies."""

    hardware: Hardware
    devices: int
    dp: int
    fsdp: int
    ep: int
    tp: int
    pp: int
    batch: float  # per-device batch (sequences)
    seq: int
    microbatches: int  # pipeline microbatches (1 without PP)
    grad_accum: int
    weight_bytes: int
    mu_bytes: int
    act_bytes: int
    remat: dict[str, str]  # tensor -> device | offload | remat
    remat_name: str
    ragged_buffer_factor: float
    moe_path: str  # grouped-GEMM kernel: te (TE block or ours with moe.gemm te), tokamax, ragged_dot, dense
    dense_fp8: bool
    expert_fp8: bool
    vocab_tiling: int
    mem_fraction: float
    latency_hiding: bool
    offload_optimizer: bool
    offload_params: bool
    dedup_dispatch: bool  # EP sends a token once per destination rank (our block), not once per expert
    weights_before_wo: bool  # our block: routed copies scaled before wo, up-projections kept as one tensor
    dense_exchange: bool  # ours over XLA's plain all-to-all: one block of T rows to every peer (moe.exchange auto)
    scanned: bool  # MaxText's scan_layers: one loop over the layers, whose backward carries the stacked gradients
    slice_fusion: bool  # XLA's dynamic-slice fusion, which runs a scanned loop's saved TE GEMMs twice

    @property
    def placement(self) -> dict[str, str]:
        """`remat` as our block meets it: the routed wo output is read by no backward pass ("unread": saved by
        no policy and recomputed by none), since the block weights the copies before wo (MaxText's blocks after
        it, and the weights' gradient reads the output); and the up-projections are one tensor placed by the
        outermost of its names (`moe/remat_names.py`)."""
        if not self.weights_before_wo:
            return self.remat
        up = up_output_placement(self.remat)
        return self.remat | {"moe_mlpwo": "unread", "moe_mlpwi_0": up, "moe_mlpwi_1": up}

    @property
    def tokens(self) -> float:
        """Tokens each device processes per optimizer step (all accumulation steps)."""
        return self.batch * self.seq * self.grad_accum

    @property
    def pass_tokens(self) -> float:
        """Tokens one device holds activations for in one forward/backward pass."""
        return self.batch * self.seq

    @property
    def usable_gib(self) -> float:
        return self.hardware.cuda_memory_gib * self.mem_fraction

    def describe(self) -> str:
        axes = [
            f"{n}{v}"
            for n, v in (("DP", self.dp), ("FSDP", self.fsdp), ("EP", self.ep), ("TP", self.tp), ("PP", self.pp))
            if v > 1
        ] or ["1 device"]
        return (
            f"{' x '.join(axes)} on {self.devices} {self.hardware.name}, batch {self.batch:g}/device x seq "
            f"{self.seq}, remat {self.remat_name}"
        )

    def replace(self, **changes: object) -> Layout:
        return dataclasses.replace(self, **changes)


def _mesh(r: ResolvedRecipe, devices: int) -> dict[str, int]:
    """ici_* sizes with -1 filled in; with a device count other than the recipe's, FSDP absorbs it."""
    names = {
        "dp": "ici_data_parallelism",
        "fsdp": "ici_fsdp_parallelism",
        "ep": "ici_expert_parallelism",
        "tp": "ici_tensor_parallelism",
        "pp": "ici_pipeline_parallelism",
    }
    sizes = {k: int(r.effective(v)) for k, v in names.items()}
    for key in (
        "ici_fsdp_transpose_parallelism",
        "ici_sequence_parallelism",
        "ici_context_parallelism",
        "ici_tensor_sequence_parallelism",
        "ici_autoregressive_parallelism",
    ):
        if r.effective(key) not in (1, None):
            raise UserError(
                f"is {r.effective(key)}; plan models DP, FSDP, EP, TP and PP axes only.",
                key=key,
                source=r.sources.get(f"maxtext.{key}"),
                fix=f"set {key}: 1 to plan this recipe.",
            )
    if devices != r.topology.num_devices:
        sizes["fsdp"] = -1
    fill = [k for k, v in sizes.items() if v == -1]
    known = 1
    for v in sizes.values():
        known *= v if v != -1 else 1
    if devices % known:
        raise UserError(
            f"--gpus {devices} is not a multiple of the other mesh axes (product {known}: "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items() if v not in (1, -1))}).",
            key="--gpus",
            fix=f"use a multiple of {known}, or change those axes with key=value overrides.",
        )
    for k in fill:
        sizes[k] = devices // known
        known = devices
    return sizes


def _remat(r: ResolvedRecipe) -> dict[str, str]:
    """Where each named tensor lives under the recipe's policy; `attention.residuals: save` keeps the
    attention output (and its statistics) on the device whatever the policy (`remat.py`)."""
    choices = _policy_tensors(r)
    if r.attention["residuals"] == "save":
        choices["context"] = "device"
    return choices


def _policy_tensors(r: ResolvedRecipe) -> dict[str, str]:
    policy = str(r.effective("remat_policy"))
    if policy == "custom":
        choices = {t: str(r.effective(t)) for t in REMAT_TENSORS}
        bad = {t: v for t, v in choices.items() if v not in ("device", "offload", "remat")}
        if bad:
            t, v = next(iter(bad.items()))
            raise UserError(
                f"is {v!r}; a custom remat policy takes device, offload or remat.",
                key=t,
                source=r.sources.get(f"maxtext.{t}"),
                fix=f"set {t}: remat, device or offload.",
            )
        return choices
    if policy not in REMAT_PRESETS:
        raise UserError(
            f"is {policy!r}, which plan does not model.{suggest(policy, tuple(REMAT_PRESETS))}",
            key="remat_policy",
            source=r.sources.get("maxtext.remat_policy"),
            fix=f"use custom or one of: {', '.join(REMAT_PRESETS)}.",
        )
    return {t: REMAT_PRESETS[policy].get(t, "remat") for t in REMAT_TENSORS}


def _dtype_bytes(r: ResolvedRecipe, key: str, fallback: str) -> int:
    name = str(r.effective(key) or fallback)
    if name not in DTYPE_BYTES:
        raise UserError(
            f"is {name!r}; plan knows {', '.join(DTYPE_BYTES)}.",
            key=key,
            source=r.sources.get(f"maxtext.{key}"),
            fix="use bfloat16 or float32.",
        )
    return DTYPE_BYTES[name]


def from_recipe(r: ResolvedRecipe, gpus: int | None = None, gpu_type: str | None = None) -> Layout:
    """The recipe's layout, optionally moved to `gpus` devices of `gpu_type` (FSDP absorbs the change)."""
    if gpu_type is not None and gpu_type not in PROFILES:
        raise UserError(
            f"unknown GPU type '{gpu_type}'.{suggest(gpu_type, tuple(PROFILES))}",
            key="--gpu-type",
            fix=f"use one of: {', '.join(p for p in PROFILES if p != 'cpu')}.",
        )
    if gpus is not None and gpus < 1:
        raise UserError(f"must be at least 1, got {gpus}.", key="--gpus", fix="give the number of GPUs to plan for.")
    hw = profile(gpu_type or r.topology.hardware)
    devices = gpus or r.topology.num_devices
    mesh = _mesh(r, devices)
    weight_bytes = _dtype_bytes(r, "weight_dtype", "float32")
    quant = str(r.effective("quantization") or "")
    te = bool(r.effective("te_moe_block"))
    moe = r.moe_settings
    if moe.ours:  # our block: the recipe's moe.gemm picks the grouped-GEMM kernel
        moe_path = moe.gemm
    else:
        moe_path = (
            "te"
            if te
            else "tokamax"
            if r.effective("use_tokamax_gmm")
            else "ragged_dot"
            if r.effective("sparse_matmul")
            else "dense"
        )
    flags = str(r.env.get("XLA_FLAGS", ""))
    pp = mesh["pp"]
    return Layout(
        hardware=hw,
        devices=devices,
        dp=mesh["dp"],
        fsdp=mesh["fsdp"],
        ep=mesh["ep"],
        tp=mesh["tp"],
        pp=pp,
        batch=float(r.effective("per_device_batch_size")),
        seq=int(r.effective("max_target_length")),
        microbatches=max(int(r.effective("num_pipeline_microbatches")), pp) if pp > 1 else 1,
        grad_accum=int(r.effective("gradient_accumulation_steps")),
        weight_bytes=weight_bytes,
        mu_bytes=_dtype_bytes(r, "mu_dtype", str(r.effective("weight_dtype"))),
        act_bytes=_dtype_bytes(r, "dtype", "bfloat16"),
        remat=_remat(r),
        remat_name=str(r.effective("remat_policy")),
        ragged_buffer_factor=float(r.effective("ragged_buffer_factor")),
        moe_path=moe_path,
        dense_fp8="fp8" in quant and hw.fp8,
        # The expert GEMMs run in FP8 through TE's block with MXFP8, or through ours with `moe.fp8`;
        # `quantization` reaches the dense GEMMs alone.
        expert_fp8=hw.fp8 and (moe.expert_fp8 or (te and r.effective("te_gmm_quantization") == "te_mxfp8")),
        vocab_tiling=max(1, int(r.effective("num_vocab_tiling"))),
        mem_fraction=float(r.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_DEFAULT_MEM_FRACTION)),
        latency_hiding="xla_gpu_enable_latency_hiding_scheduler=true" in flags,
        offload_optimizer=bool(r.effective("optimizer_memory_host_offload")),
        offload_params=bool(r.effective("parameter_memory_host_offload")),
        dedup_dispatch=moe.ours,
        weights_before_wo=moe.ours,
        scanned=bool(r.effective("scan_layers")),
        slice_fusion=r.slice_fusion,
        dense_exchange=moe.ours and moe.exchange_impl == "all_to_all",
    )
