"""TE's grouped FP8 GEMM with current scaling, its per-group scales found by `te_group_scales` and its weights
quantized by XLA, against TE's own quantize: the same FP8 data, outputs and gradients bit for bit, no scatter
left in the compiled step and one TE quantize call fewer (needs a GPU)."""

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


QUANTIZE_CALL = 'custom_call_target="te_grouped_quantize_ffi"'


def test_kernel_quantized_by_xla_equals_te_quantize() -> None:
    """Both layouts of a [G, K, N] weight (the transposed copy feeds the input-gradient GEMM) and the scales,
    for E4M3 and E5M2, one expert all zeros (scale 1, as TE's rule gives) and one at a large magnitude."""
    quantize = importlib.import_module(te_group_scales.QUANTIZE)
    extensions = importlib.import_module(te_group_scales.EXTENSIONS)
    te_own = getattr(extensions.grouped_quantize, "wrapped", extensions.grouped_quantize)
    w = jax.random.normal(jax.random.key(3), (4, 256, 128), jnp.bfloat16) * jnp.array([1e-3, 1, 0, 3e3])[:, None, None]
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        quantizer = quantize.QuantizerFactory.create(
            n_quantizers=1,
            scaling_mode=quantize.ScalingMode.CURRENT_TENSOR_SCALING,
            q_dtype=dtype,
            q_layout=quantize.QuantizeLayout.ROWWISE_COLWISE,
            n_groups=4,
        )
        theirs = jax.jit(lambda w, q=quantizer: te_own(w, q))(w)
        ours = jax.jit(lambda w, q=quantizer: te_group_scales.quantized_kernel(w, q))(w)
        for layout in ("rowwise_tensor", "colwise_tensor"):
            a, b = getattr(ours, layout), getattr(theirs, layout)
            assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype == dtype
            np.testing.assert_array_equal(np.asarray(a.data, np.float32), np.asarray(b.data, np.float32))
            np.testing.assert_array_equal(np.asarray(a.scale_inv), np.asarray(b.scale_inv))


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
    # TE quantizes the rows and the output gradient; the weight is XLA's.
    assert (theirs_hlo.count(QUANTIZE_CALL), ours_hlo.count(QUANTIZE_CALL)) == (3, 2)
    for a, b in ((y, y_te), (dx, dx_te), (dw, dw_te)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
