"""`attention.bf16_projections` (`upstream/bf16_projections.py`) on TE's own wrapper module: a chosen projection's
kernel computes XLA's BF16 dot exactly, forward and backward, while the others stay on TE's FP8 GEMM. Needs a GPU
(TE's FP8 GEMM)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.upstream import bf16_projections

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU"),
]

DIMS = (((1,), (0,)), ((), ()))


def projection(quant: object, name: str):  # noqa: ANN201
    """y = x @ k and its gradients through the module MaxText's DenseGeneral builds for `name`'s kernel."""
    module = quant.dot_general_cls(mesh_axes=bf16_projections.PROJECTIONS[name])()
    x = jax.random.normal(jax.random.key(0), (256, 512), jnp.bfloat16)
    k = (jax.random.normal(jax.random.key(1), (512, 384)) * 512**-0.5).astype(jnp.bfloat16)
    variables = module.init(jax.random.key(2), x, k, DIMS)

    def loss(x: jax.Array, k: jax.Array) -> jax.Array:
        return jnp.sum(module.apply(variables, x, k, DIMS).astype(jnp.float32) ** 2)

    y = jax.jit(lambda x, k: module.apply(variables, x, k, DIMS))(x, k)
    return (y, *jax.jit(jax.grad(loss, argnums=(0, 1)))(x, k)), x, k


def test_chosen_projections_compute_bf16_and_the_rest_fp8() -> None:
    from maxtext.layers.quantizations import TeCommGemmOverlapPolicy, TransformerEngineQuantization

    quant = TransformerEngineQuantization(
        SimpleNamespace(quantization="te_fp8_currentscaling", te_comm_gemm_overlap=TeCommGemmOverlapPolicy.DISABLED)
    )
    try:
        bf16_projections.install(["wkv_b"])
        (y, dx, dk), x, k = projection(quant, "wkv_b")
        ref = jax.lax.dot_general(x, k, DIMS)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
        ref_dx, ref_dk = jax.grad(
            lambda x, k: jnp.sum(jax.lax.dot_general(x, k, DIMS).astype(jnp.float32) ** 2), argnums=(0, 1)
        )(x, k)
        np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(ref_dx, np.float32), rtol=2e-2, atol=1e-2)
        np.testing.assert_allclose(np.asarray(dk, np.float32), np.asarray(ref_dk, np.float32), rtol=2e-2, atol=1e-2)

        (y8, _, _), _, _ = projection(quant, "wkv_a")  # not chosen: TE's FP8, close to BF16 but not equal
        err = float(jnp.linalg.norm((y8 - ref).astype(jnp.float32)) / jnp.linalg.norm(ref.astype(jnp.float32)))
        assert 0 < err < 0.1
    finally:
        bf16_projections.install([])
    (y8, _, _), _, _ = projection(quant, "wkv_b")  # none chosen: FP8 again
    assert not np.array_equal(np.asarray(y8, np.float32), np.asarray(ref, np.float32))
