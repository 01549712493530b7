"""Compile for NVIDIA GPUs on a machine that has none: XLA's deviceless ahead-of-time compilation.

JAX's CUDA plugin (`jax[cuda13]`, in the `gpu` extra) describes a GPU topology from a target config
without a device (`jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)`),
and XLA:GPU compiles a sharded program for its devices, so `plan --compile` can give a GPU compile's
memory on a login node or this project's CPU machine. What stands in the way is library code that asks the
live GPU while the step is traced, which these patches answer with the target's figures instead:
- Transformer Engine's `get_device_compute_capability` (FP8 support, the cuBLAS workspace size), imported
  by name into several of its modules;
- JAX's cuDNN attention (`check_compute_capability`, `is_cuda_compute_capability_equal`);
- host callbacks (`jax.debug.callback`), which need a live backend to lower: our dropless and EP overflow
  checks (`moe/layer.py`, `moe/receive.py`) send one scalar to the host; they are left out of this compile.
And one thing a GPU gives the compile that a described device does not: JAX passes XLA the limit of the
process's GPU allocator as the device's memory size, which XLA's scheduler and rematerialization budget from
(`plan/scheduler_limit.py`). Without it XLA budgets from 80% of the device's memory, so a recipe whose
`XLA_PYTHON_CLIENT_MEM_FRACTION` is not 0.8 would compile to another schedule than its run's; `pass_memory_size`
gives the deviceless compile the same limit.
The plugin's own start-up check of the CUDA libraries needs a driver and is skipped
(`JAX_SKIP_CUDA_CONSTRAINTS_CHECK`, set by `plan.compiled`).
"""

from __future__ import annotations

import sys
from typing import Any

from maxtext_moe.recipe.hardware import Hardware

# SMs per GPU, by hardware profile: a figure of the target config the profiles do not hold.
SM_COUNT = {"h100": 132, "h200": 132, "gb200": 148, "gb300": 160}


def available() -> bool:
    """Whether JAX's CUDA plugin is installed here (checked without starting jax)."""
    from importlib.util import find_spec

    if find_spec("jax_plugins") is None:  # a submodule's find_spec raises when its package is missing
        return False
    return find_spec("jax_plugins.xla_cuda13") is not None or find_spec("jax_plugins.xla_cuda12") is not None


def device_memory_bytes(hw: Hardware) -> int:
    """A `hw` GPU's memory as XLA sees it, which its scheduler weighs against the step's buffers (the compiled
    temporaries move with it: one H200 proxy, 58.4 GiB at the vendor's 141 GB, 59.8 at nvidia-smi's 143,771 MiB).
    A GPU describes itself with cuDeviceTotalMem, the total CUDA reports: on the H200 150,109,880,320 bytes
    (139.80 GiB, docs/results/h200_device_memory_2026-12-02.txt); the profile holds 139.81 GiB, 10 MB more."""
    return round(hw.cuda_memory_gib * 2**30)


def target_config(hw: Hardware) -> str:
    """XLA's `GpuTargetConfig` text for a device of profile `hw` (CUDA 13, cuDNN 9). SMs, memory, bandwidth and
    compute capability are the kind's; the other fields are Hopper's, inputs to XLA's cost models."""
    major, minor = hw.compute_capability or (0, 0)
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: {SM_COUNT[hw.name]}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(hw.hbm_tbps * 1e12)}
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: {device_memory_bytes(hw)}
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 19 }}
runtime_version {{ major: 13 minor: 0 }}
device_description_str: "NVIDIA {hw.name.upper()} (deviceless target)"
"""


def devices(hw: Hardware, topology: str) -> list[Any]:
    """The devices of a `slices x hosts x GPUs` topology of `hw` GPUs, described without any GPU."""
    from jax.experimental import topologies

    return list(
        topologies.get_topology_desc(platform="cuda", target_config=target_config(hw), topology=topology).devices
    )


def patch(compute_capability: tuple[int, int]) -> None:
    """Answer the libraries' trace-time GPU queries with `compute_capability` and drop host callbacks (see
    the module docstring). Call once, before the step is traced."""
    import jax
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    cudnn_attention.check_compute_capability = lambda c: compute_capability >= version(c)
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: compute_capability == version(c)
    jax.debug.callback = lambda *args, **kwargs: None
    try:
        import transformer_engine.jax.cpp_extensions.gemm  # noqa: F401  (loads every module that asks)
    except ImportError:  # a recipe without TE traces no TE code
        return
    sm = 10 * compute_capability[0] + compute_capability[1]
    for name, module in list(sys.modules.items()):
        if name.startswith("transformer_engine") and hasattr(module, "get_device_compute_capability"):
            module.get_device_compute_capability = lambda *args, **kwargs: sm


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


# `CompileOptionsProto.executable_build_options` (field 3) and its `device_memory_size` (field 15), in
# xla/pjrt/proto/compile_options.proto: the field JAX's client sets from its allocator's limit.
_BUILD_OPTIONS_FIELD, _DEVICE_MEMORY_SIZE_FIELD = 3, 15


def with_memory_size(options: Any, memory_bytes: int) -> Any:
    """`options` (an `xla_client.CompileOptions`) with the device memory size set. JAX's Python binding has no
    setter for it; a second embedded build-options message, holding only that field, merges into the first
    when protobuf parses the bytes."""
    from jax._src.lib import xla_client

    inner = _varint(_DEVICE_MEMORY_SIZE_FIELD << 3) + _varint(memory_bytes)
    extra = _varint(_BUILD_OPTIONS_FIELD << 3 | 2) + _varint(len(inner)) + inner
    return xla_client.CompileOptions.ParseFromString(options.SerializeAsString() + extra)


def pass_memory_size(memory_bytes: int) -> None:
    """Give every compile of this process `memory_bytes` as the device's memory size, as JAX does on a GPU
    (see the module docstring). Call once, before the step is compiled; 0 leaves XLA's own 80% rule."""
    if not memory_bytes:
        return
    from jax._src import compiler

    compile_and_load = compiler.backend_compile_and_load

    def with_allocator_limit(backend: Any, module: Any, devices: Any, options: Any, callbacks: Any) -> Any:
        return compile_and_load(backend, module, devices, with_memory_size(options, memory_bytes), callbacks)

    compiler.backend_compile_and_load = with_allocator_limit
