"""Small `jnp.empty` placeholders lowered as zero constants on GPUs, so that XLA merges TE's repeated FP8 casts.

The gap: from JAX 0.11, `jnp.empty` (`lax.empty`) lowers on GPUs to XLA's `AllocateBuffer` custom call, and
XLA's common-subexpression elimination keeps each of those apart. TE 2.20.2's `quantize` hands every cast such a
placeholder (its Hadamard matrix operand, bf16[1, 1], unread without RHT), so two casts of one tensor with one
scale are different instructions to XLA and both run. In the FP8 proxy's step that is 22 casts of [8, 4096,
7168] a step: MLA's wq_a and wkv_a read the same input, as do the MLPs' wi_0 and wi_1. Lowered as constant
zeros, as JAX lowered every `jnp.empty` before 0.11, the placeholders are equal, and XLA keeps one cast of
each tensor. Only empties of at most `MAX_ELEMENTS` elements change: a larger one (a buffer its user fills)
keeps its uninitialised allocation and costs no fill.
"""

from __future__ import annotations

import math
from typing import Any

MAX_ELEMENTS = 1024
_installed = False


def install() -> None:
    """Lower small `lax.empty` arrays as zero constants for GPU targets in this process (once)."""
    global _installed
    if _installed:
        return
    from jax._src import core
    from jax._src.lax import lax as jax_lax
    from jax.interpreters import mlir

    def lower(ctx: Any, *, shape: tuple[int, ...], dtype: Any, out_sharding: Any) -> Any:
        small = core.is_constant_shape(shape) and math.prod(shape) <= MAX_ELEMENTS
        rule = jax_lax._empty_lower if small else jax_lax._empty_custom_call_lower
        return rule(ctx, shape=shape, dtype=dtype, out_sharding=out_sharding)

    mlir.register_lowering(jax_lax.empty_p, lower, "gpu")
    _installed = True
