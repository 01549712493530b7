"""With `placeholder_constants` installed, XLA keeps one TE FP8 cast of a tensor that two dense GEMMs read (MLA's
wq_a and wkv_a, say), and the step computes the same values as with the tensor cast twice. Needs a GPU."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.upstream import placeholder_constants

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU"),
]

CAST = 'custom_call_target="te_dbias_quantize_ffi"'


def two_projections(xa: jax.Array, xb: jax.Array, wa: jax.Array, wb: jax.Array) -> jax.Array:
    """The loss of two FP8 projections, of `xa` and of `xb`, under TE's per-tensor current scaling."""
    q = importlib.import_module("transformer_engine.jax.quantize")
    dense = importlib.import_module("transformer_engine.jax.dense")

    def quantizers() -> object:
        return q.QuantizerFactory.create_set(
            scaling_mode=q.ScalingMode.CURRENT_TENSOR_SCALING,
            fwd_dtype=jnp.float8_e4m3fn,
            bwd_dtype=jnp.float8_e5m2,
        )

    a = dense.dense(xa, wa, quantizer_set=quantizers())
    b = dense.dense(xb, wb, quantizer_set=quantizers())
    return jnp.sum(jnp.square(a.astype(jnp.float32))) + jnp.sum(b.astype(jnp.float32))


def test_one_cast_of_a_shared_input_and_the_same_values() -> None:
    placeholder_constants.install()
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (2048, 1024), jnp.bfloat16)
    wa = jax.random.normal(keys[1], (1024, 512), jnp.bfloat16) * 0.03
    wb = jax.random.normal(keys[2], (1024, 192), jnp.bfloat16) * 0.03

    shared = jax.jit(jax.value_and_grad(lambda x, wa, wb: two_projections(x, x, wa, wb), argnums=(0, 1, 2)))
    # The same tensor passed twice, as two arguments: XLA cannot know they are equal, so it casts both.
    apart = jax.jit(jax.value_and_grad(two_projections, argnums=(0, 1, 2, 3)))

    shared_casts = shared.lower(x, wa, wb).compile().as_text().count(CAST)
    apart_casts = apart.lower(x, x, wa, wb).compile().as_text().count(CAST)
    assert shared_casts == apart_casts - 1, (shared_casts, apart_casts)

    loss, (dx, dwa, dwb) = shared(x, wa, wb)
    loss_apart, (dxa, dxb, dwa_apart, dwb_apart) = apart(x, x, wa, wb)
    # The weight gradients come from the same FP8 operands through the same GEMMs: equal bit for bit. The loss and
    # the input's gradient add the two projections' parts in another program, whose sums may round apart.
    np.testing.assert_array_equal(np.asarray(dwa, np.float32), np.asarray(dwa_apart, np.float32))
    np.testing.assert_array_equal(np.asarray(dwb, np.float32), np.asarray(dwb_apart, np.float32))
    np.testing.assert_allclose(np.asarray(loss), np.asarray(loss_apart), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dxa + dxb, np.float32), rtol=2**-7, atol=1e-5)
