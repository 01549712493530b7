"""Which compiler `plan RECIPE --compile` uses on this machine, and what it changes in the recipe to compile there.

Three routes, chosen by what this machine has:

- `gpu`: JAX's mock GPU topology over this machine's NVIDIA GPUs (XLA's GPU compiler, the recipe as is).
  Sharded autotuning is switched off: a sharded compile under the mock topology waits for peers that
  do not exist.
- `gpu-aot`: on a machine without GPUs that has JAX's CUDA plugin (the `gpu` extra), XLA:GPU's deviceless
  compile for the recipe's GPU kind and count (`upstream/deviceless.py`, the recipe as is).
- `cpu`: N XLA:CPU host devices, with the recipe's hardware switched to what compiles there (our MoE
  block on `ragged_dot`, `dot_product` attention, no TE, no FP8). Its buffers are the CPU compiler's: how
  far they sit from a GPU compile's is unknown until the two are measured on the same recipe.

No jax here: `doctor` names the route a machine would take without starting a compile.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe

# XLA:CPU compiles one SPMD program whatever N is, but its partitioner and collective passes grow with the
# device count; beyond this many host devices the compile is refused rather than left to run for hours.
MAX_CPU_DEVICES = 256
# What XLA:GPU needs under the mock topology; see the module docstring. Autotuning is off altogether: it
# times candidate kernels on the real GPU, which would disturb anything else running there, and only picks
# among kernels; the one-GPU proxy's compiled total with and without it is in docs/PLAN.md.
MOCK_GPU_FLAGS = "--xla_gpu_shard_autotuning=false --xla_gpu_autotune_level=0"
# The switches that make a GPU recipe compile on XLA:CPU (see the module docstring).
CPU_SWITCHES = (
    "topology.hardware=cpu",
    "moe.impl=ours",
    "moe.gemm=ragged_dot",
    "moe.fp8=none",
    "attention.residuals=recompute",
    "attention.kernel=cudnn",
    "attention=dot_product",
    "te_moe_block=false",
    "prefuse_moe_weights=false",
    "use_tokamax_gmm=false",
    "quantization=''",
)


@dataclass(frozen=True)
class Route:
    name: str  # "gpu" (mock topology), "gpu-aot" (deviceless) or "cpu"
    description: str
    overrides: tuple[str, ...]  # added to the user's before the recipe is resolved for the compile
    env: dict[str, str]
    mock_gpu_topology: str | None
    deviceless_topology: str | None = None  # "slices x hosts x GPUs" of the recipe's GPU kind, no device here


def local_gpus() -> int:
    """NVIDIA GPUs this process may use (0 without a driver), counted without starting jax in this process:
    `CUDA_VISIBLE_DEVICES` when set (the mock topology's GPUs per host must be the ones jax will see)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _data_stand_in(r: ResolvedRecipe) -> tuple[str, ...]:
    """Synthetic batches for a recipe whose prepared corpus is not named yet: MaxText's config refuses Grain
    without files, and the compiled step sees only the batch's shapes, which the corpus does not change."""
    reads_prepared = r.maxtext.get("dataset_type") == "grain" and r.maxtext.get("tokenize_train_data") is False
    return ("dataset_type=synthetic",) if reads_prepared and not r.maxtext.get("grain_train_files") else ()


def choose_route(r: ResolvedRecipe, gpus_here: int, deviceless_ok: bool = False) -> Route:
    """The mock GPU topology where this machine has GPUs and the recipe is for GPUs; without GPUs, XLA:GPU's
    deviceless compile when JAX's CUDA plugin is installed (`deviceless_ok`); else XLA:CPU devices."""
    n = r.topology.num_devices
    data = _data_stand_in(r)
    gpu_recipe = r.topology.profile.maxtext_hardware == "gpu"
    # MaxText bootstraps TE's NCCL EP before a te_moe_block step: real communicators between real processes.
    # Without a GPU such a recipe takes the CPU route, which switches the block off.
    te_moe_block = bool(r.effective("te_moe_block"))
    if gpu_recipe and gpus_here and te_moe_block:
        raise UserError(
            "a recipe with TE's MoE block (te_moe_block) cannot be compiled on the mock GPU topology: MaxText "
            "bootstraps TE's NCCL EP before the step (max_utils.maybe_bootstrap_te_moe), which opens real NCCL "
            "communicators between real processes.",
            key="te_moe_block",
            fix="compile it without GPUs (CUDA_VISIBLE_DEVICES='', the CPU route switches the block off), or "
            "run one step on the cluster (train RECIPE steps=1).",
        )
    flags = " ".join([r.env.get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")), MOCK_GPU_FLAGS]).strip()
    if gpu_recipe and gpus_here:
        if n % gpus_here:
            raise UserError(
                f"the recipe's {n} GPUs are not a whole number of hosts of this machine's {gpus_here} GPU(s): "
                "the mock topology repeats this machine's GPUs per host.",
                key="topology",
                fix=f"compile on a machine whose GPU count divides {n}, or without GPUs (CUDA_VISIBLE_DEVICES='').",
            )
        topo = f"1x{n // gpus_here}x{gpus_here}"
        return Route(
            "gpu",
            f"XLA:GPU on a mock topology {topo} ({n} devices, {n // gpus_here} processes) of this machine's GPU kind; "
            "nothing executed",
            data,
            {"XLA_FLAGS": flags},
            topo,
        )
    if gpu_recipe and deviceless_ok and not te_moe_block:
        hw, per_node = r.topology.profile, r.topology.gpus_per_node
        topo = f"1x{n // per_node}x{per_node}" if n % per_node == 0 else f"1x1x{n}"
        # TE's attention asks the GPU driver which fused kernel it has while the step is traced; JAX's cuDNN
        # flash attention (the Hopper recipes' kernel, also linear in the sequence) compiles without one.
        te_attention = r.effective("attention") == "cudnn_flash_te"
        # FA3 (attention.kernel: fa3) keeps the same two tensors for its backward as cuDNN's kernel; its library
        # may be absent where the plan runs, so cuDNN's stands in.
        fa3 = r.attention["kernel"] == "fa3"
        return Route(
            "gpu-aot",
            f"XLA:GPU deviceless for {n} {hw.name.upper()} GPUs (topology {topo}, SM "
            f"{'.'.join(map(str, hw.compute_capability or ()))}) on a "
            "machine without them; nothing executed, the dropless/overflow host checks left out"
            + (
                "; JAX's cuDNN flash attention in place of TE's attention, which asks a GPU driver for its kernel"
                if te_attention
                else ""
            )
            + ("; cuDNN's flash attention in place of FlashAttention-3 (the same residuals)" if fa3 else ""),
            (
                *data,
                *(("attention=cudnn_flash_jax",) if te_attention else ()),
                *(("attention.kernel=cudnn",) if fa3 else ()),
            ),
            {
                "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={n}",  # MaxText's device count
                "JAX_PLATFORMS": "cpu",
                "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",  # the plugin's library check needs a driver
            },
            None,
            topo,
        )
    if n > MAX_CPU_DEVICES:
        raise UserError(
            f"compiling for {n} devices on the CPU is refused here (at most {MAX_CPU_DEVICES} XLA:CPU devices; "
            "no NVIDIA GPU was found for the mock GPU topology).",
            key="--compile",
            fix="run it on a machine with an NVIDIA GPU, or compile a smaller layout of the recipe "
            "(e.g. topology.nodes=... overrides).",
        )
    switches = () if r.topology.profile.maxtext_hardware == "cpu" else CPU_SWITCHES
    return Route(
        "cpu",
        f"XLA:CPU with {n} host devices"
        + (
            ", the recipe switched to CPU kernels (our block on ragged_dot, dot_product attention, no TE/FP8)"
            if switches
            else ""
        )
        + "; its bias against a GPU compile is unknown until measured",
        (*switches, *data, "topology.nodes=1", f"topology.gpus_per_node={n}"),
        {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"},
        None,
    )
