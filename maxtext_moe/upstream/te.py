"""Transformer Engine internals we touch (TE 2.20.2): its grouped-GEMM path flag and its JAX bindings.

The gap: TE picks its single-kernel grouped GEMM ("V2") from the cuBLAS version it was compiled
against and offers no public switch; on a runtime cuBLASLt older than 13.4 that kernel fails on Hopper.
TE reads the module flag `_v2_grouped_gemm_available` at trace time, so clearing it selects the per-group
path ("V1"). Everything here is one place to look when TE is upgraded (see `SYMBOLS` in `__init__`).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from maxtext_moe.errors import UserError

GEMM_MODULE = "transformer_engine.jax.cpp_extensions.gemm"
V2_FLAG = "_v2_grouped_gemm_available"


def import_te() -> tuple[ModuleType, ModuleType]:
    """TE's `dense` module and its C++ extension, or a UserError saying what to install; we never fall back
    to another grouped-GEMM backend silently."""
    import jax

    jax.devices()  # initialise the CUDA plugin first: it loads the cuBLAS/cudart that TE's library binds to
    try:
        dense = importlib.import_module("transformer_engine.jax.dense")
        tex = importlib.import_module("transformer_engine_jax")
    except ImportError as e:
        raise UserError(
            f"backend 'te' needs Transformer Engine's JAX bindings, which do not import here ({e}).",
            fix="install transformer-engine[jax]==2.20.2 (pip install '.[gpu]'), or choose "
            "backend 'tokamax' or 'ragged_dot'.",
        ) from None
    return dense, tex


def runtime_cublaslt() -> int:
    """The cuBLASLt version TE's extension sees at run time (e.g. 130100 for 13.1)."""
    return int(import_te()[1].get_cublasLt_version())


def v2_grouped_gemm_compiled() -> bool:
    """Whether this TE build would use its single-kernel grouped GEMM (before any `use_per_group_gemm`)."""
    import_te()
    return bool(getattr(sys.modules[GEMM_MODULE], V2_FLAG, False))


def use_per_group_gemm(reason: str) -> None:
    """Make TE's grouped GEMM run one GEMM per group ("V1") in this process from now on."""
    import_te()
    module = sys.modules[GEMM_MODULE]
    setattr(module, V2_FLAG, False)
    module._v2_grouped_gemm_available_reason = f"maxtext_moe: {reason}"
