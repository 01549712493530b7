"""Make a block's weight gradients in the backward pass before the gradient it passes to the layer below.

Why: a weight gradient has no consumer before the optimizer, and XLA's scheduler (with or without its
latency-hiding scheduler) placed each layer's weight-gradient GEMMs, then their reduce-scatters, at the end
of the backward pass. Compiled for DeepSeek-V3 671B on 128 H200s, the FP8 copies of those GEMMs' operands
(1.6 GiB each for an EP rank's receive rows) and their full-shard results stayed alive across every layer
below (its 9-layer variant: 92.1 GiB per GPU, 49.7 with this; docs/PLAN.md). Neither JAX nor TE exposes
an order for the backward; an optimization barrier on the block's cotangents does: the input gradient
leaves the block only together with the weight gradients, so they are made, and reduce-scattered, while
the layer's own operands are alive."""

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
