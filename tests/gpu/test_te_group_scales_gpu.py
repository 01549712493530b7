"""TE's grouped FP8 quantize with current scaling done by XLA (`te_group_scales.xla_cast`) against TE's own
kernels: the same FP8 bytes and scales, the same grouped GEMM outputs and gradients bit for bit, and neither
TE's quantize call nor a scatter left in the compiled step; the same for TE's cast with our scatter-free scales
(`scatter_free`, what tensors of 2^31 elements or more take). Needs a GPU."""

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

SIZES = [304, 0, 704, 128, 144, 496, 16, 2304]  # multiples of 16, one empty group


def te_own() -> object:
    extensions = importlib.import_module(te_group_scales.EXTENSIONS)
    return getattr(extensions.grouped_quantize, "wrapped", extensions.grouped_quantize)


def as_bytes(a: jax.Array) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


@pytest.mark.parametrize("tensor", ["rows", "weights", "gradient"])
def test_xla_cast_gives_te_bytes_and_scales(tensor: str) -> None:
    q = importlib.import_module(te_group_scales.QUANTIZE)
    quantizers = q.QuantizerFactory.create_set(
        scaling_mode=q.ScalingMode.CURRENT_TENSOR_SCALING,
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e5m2,
        n_groups=len(SIZES),
    )
    sizes = jnp.array(SIZES, jnp.int32)
    rows = jax.random.normal(jax.random.key(0), (sum(SIZES), 512)) * jnp.linspace(0.1, 30, sum(SIZES))[:, None]
    weights = jax.random.normal(jax.random.key(1), (len(SIZES), 512, 256)) * jnp.arange(1, 9)[:, None, None]
    x, quantizer, groups = {
        "rows": (rows, quantizers.x, sizes),
        "weights": (weights, quantizers.kernel, None),
        "gradient": (rows, quantizers.dgrad, sizes),
    }[tensor]
    x = x.astype(jnp.bfloat16)
    theirs = jax.jit(lambda x: te_own()(x, quantizer, groups))(x)
    ours = jax.jit(lambda x: te_group_scales.xla_cast(te_own())(x, quantizer, groups))(x)
    filled = int(np.count_nonzero(SIZES)) if groups is not None else len(SIZES)  # TE writes these scales only
    for a, b in ((ours.rowwise_tensor, theirs.rowwise_tensor), (ours.colwise_tensor, theirs.colwise_tensor)):
        np.testing.assert_array_equal(as_bytes(a.data), as_bytes(b.data))
        np.testing.assert_array_equal(np.asarray(a.scale_inv)[:filled], np.asarray(b.scale_inv)[:filled])


@pytest.mark.parametrize(("wrapper", "te_casts"), [("xla_cast", 0), ("scatter_free", 3)])
def test_grouped_gemm_with_our_casts_equals_te_current_scaling(
    wrapper: str, te_casts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XLA's cast, and TE's cast with scales found without a scatter (what tensors too large for the first get).
    Each of TE's grouped casts left is a host round trip."""
    extensions = importlib.import_module(te_group_scales.EXTENSIONS)
    x = jax.random.normal(jax.random.key(0), (4096, 512), jnp.bfloat16) * jnp.linspace(0.1, 30, 4096)[:, None]
    w = (jax.random.normal(jax.random.key(1), (8, 512, 256), jnp.bfloat16) / 16).astype(jnp.bfloat16)
    sizes = jnp.array(SIZES, jnp.int32)

    def step(x, w):
        def loss(x, w):
            y = gemm.grouped_matmul(x, w, sizes, "te", fp8="current_scaling", groups_aligned=True)
            return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)

    monkeypatch.setattr(te_group_scales, "install", lambda cast="te": None)
    monkeypatch.setattr(extensions, "grouped_quantize", te_own())
    theirs_hlo = jax.jit(step).lower(x, w).compile().as_text()
    (_, y_te), (dx_te, dw_te) = jax.jit(step)(x, w)
    monkeypatch.setattr(extensions, "grouped_quantize", getattr(te_group_scales, wrapper)(te_own()))
    ours_hlo = jax.jit(lambda x, w: step(x, w)).lower(x, w).compile().as_text()
    (_, y), (dx, dw) = jax.jit(lambda x, w: step(x, w))(x, w)

    te_cast = 'custom_call_target="te_grouped_quantize_ffi"'
    assert theirs_hlo.count(te_cast) == 3 and " scatter(" in theirs_hlo  # the rows, the weights, the gradient
    assert " scatter(" not in ours_hlo
    assert ours_hlo.count(te_cast) == te_casts
    for a, b in ((y, y_te), (dx, dx_te), (dw, dw_te)):
        assert np.isfinite(np.asarray(a, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
