"""Make a block's weight gradients in the backward pass before the gradient it passes to the layer below.

Why: XLA's latency-hiding scheduler lists the backward bottom-up and places each weight-gradient GEMM as
late as its users allow: the reduce-scatter of that gradient, which has no deadline before the optimizer.
Compiled for DeepSeek-V3 671B on 128 H200s, every MoE layer's expert weight-gradient GEMMs ran after the
whole backward of the layers below it, and the FP8 copies of their operands (1.6 GiB each for the receive
buffer's rows) stayed alive until then, layer after layer. Neither JAX nor TE exposes an order for the
backward; an optimization barrier on the block's cotangents does: the input gradient leaves the block
only together with the weight gradients, so they are made while the layer's own operands are alive.
"""

from __future__ import annotations

from typing import Any

import jax

Params = Any  # a pytree of weights


@jax.custom_vjp
def weight_grads_first(x: jax.Array, weights: Params) -> tuple[jax.Array, Params]:
    """Identity on (`x`, `weights`); in the backward, the cotangent of `x` waits for those of `weights`."""
    return x, weights


def _fwd(x: jax.Array, weights: Params) -> tuple[tuple[jax.Array, Params], None]:
    return (x, weights), None


def _bwd(_: None, cotangents: tuple[jax.Array, Params]) -> tuple[jax.Array, Params]:
    return jax.lax.optimization_barrier(cotangents)


weight_grads_first.defvjp(_fwd, _bwd)
