"""Each GPU grouped-GEMM backend inside the layer against the float32 dense reference (needs a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.reference import moe_reference
from maxtext_moe.moe.routing import RoutingConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU"),
]

CFG = MoEConfig(emb_dim=512, moe_mlp_dim=256, shared_mlp_dim=256,
                routing=RoutingConfig(num_experts=32, top_k=8, n_groups=8, topk_groups=4))


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("backend", ["ragged_dot", "tokamax", "te"])
def test_backend_forward_and_grad_close_to_reference(backend: str) -> None:
    params = init_params(jax.random.key(0), CFG, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1024, CFG.emb_dim), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    loss = lambda x: jnp.sum(moe_forward(params, x, CFG, backend)[0].astype(jnp.float32) * cot)  # noqa: E731
    loss_ref = lambda x: jnp.sum(moe_reference(params, x, CFG) * cot)  # noqa: E731
    y, _ = jax.jit(moe_forward, static_argnums=(2, 3))(params, x, CFG, backend)
    dx, dx_ref = jax.jit(jax.grad(loss))(x), jax.jit(jax.grad(loss_ref))(x.astype(jnp.float32))
    assert np.isfinite(np.asarray(y, np.float32)).all() and np.isfinite(np.asarray(dx, np.float32)).all()
    assert rel(y, moe_reference(params, x, CFG)) < 2e-2
    assert rel(dx, dx_ref) < 2e-2
