"""TE's grouped FP8 GEMM with current scaling, its per-group scales found by `te_group_scales` against TE's own
quantize: the same outputs and gradients bit for bit, and no scatter left in the compiled step (needs a GPU)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import gemm
from maxtext_moe.upstream import te_group_scales

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU"),
]


def test_scatter_free_scales_equal_te_current_scaling(monkeypatch: pytest.MonkeyPatch) -> None:
    extensions = importlib.import_module(te_group_scales.EXTENSIONS)
    te_own = getattr(extensions.grouped_quantize, "wrapped", extensions.grouped_quantize)
    x = jax.random.normal(jax.random.key(0), (4096, 512), jnp.bfloat16) * jnp.linspace(0.1, 30, 4096)[:, None]
    w = (jax.random.normal(jax.random.key(1), (8, 512, 256), jnp.bfloat16) / 16).astype(jnp.bfloat16)
    sizes = jnp.array([304, 0, 704, 128, 144, 496, 16, 2304], jnp.int32)  # multiples of 16, one empty group

    def step(x, w):
        def loss(x, w):
            y = gemm.grouped_matmul(x, w, sizes, "te", fp8="current_scaling", groups_aligned=True)
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)

    monkeypatch.setattr(te_group_scales, "install", lambda: None)
    monkeypatch.setattr(extensions, "grouped_quantize", te_own)
    theirs_hlo = jax.jit(step).lower(x, w).compile().as_text()
    (_, y_te), (dx_te, dw_te) = jax.jit(step)(x, w)
    monkeypatch.setattr(extensions, "grouped_quantize", te_group_scales.scatter_free(te_own))
    ours_hlo = jax.jit(lambda x, w: step(x, w)).lower(x, w).compile().as_text()
    (_, y), (dx, dw) = jax.jit(lambda x, w: step(x, w))(x, w)

    assert " scatter(" in theirs_hlo and " scatter(" not in ours_hlo
    for a, b in ((y, y_te), (dx, dx_te), (dw, dw_te)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
