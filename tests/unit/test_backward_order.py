"""`weight_grads_first`: an identity whose backward hands the input gradient on only with the weight
gradients, so XLA cannot defer the weight-gradient GEMMs past the layers below."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from conftest import jaxpr_eqns

from maxtext_moe.moe.backward_order import weight_grads_first


def block(x: jax.Array, w: dict) -> jax.Array:
    return jnp.tanh(x @ w["a"]) @ w["b"]


def test_values_and_gradients_are_unchanged() -> None:
    kx, ka, kb = jax.random.split(jax.random.key(0), 3)
    x, w = jax.random.normal(kx, (6, 4)), {"a": jax.random.normal(ka, (4, 5)), "b": jax.random.normal(kb, (5, 3))}
    tied = lambda x, w: jnp.sum(block(*weight_grads_first(x, w)) ** 2)  # noqa: E731
    plain = lambda x, w: jnp.sum(block(x, w) ** 2)  # noqa: E731
    (v, g), (v0, g0) = jax.value_and_grad(tied, (0, 1))(x, w), jax.value_and_grad(plain, (0, 1))(x, w)
    assert v == v0
    for got, want in zip(jax.tree.leaves(g), jax.tree.leaves(g0), strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_input_gradient_leaves_through_one_barrier_with_the_weight_gradients() -> None:
    """In the backward, one optimization barrier takes the input cotangent and every weight cotangent."""
    x, w = jnp.ones((6, 4)), {"a": jnp.ones((4, 5)), "b": jnp.ones((5, 3))}
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: jnp.sum(block(*weight_grads_first(x, w))), (0, 1)))(x, w)
    barriers = [e for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == 1
    shapes = sorted(tuple(v.aval.shape) for v in barriers[0].invars)
    assert shapes == [(4, 5), (5, 3), (6, 4)]
