"""`group_amax` against the amax TE 2.20.2's grouped current-scaling quantize takes (its `jnp.repeat` +
`jax.ops.segment_max`, written out here on the CPU): equal per group, empty groups included, and no scatter
in what it compiles to (the scatters are the cost it removes)."""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.upstream import te_group_scales
from maxtext_moe.upstream.te_group_scales import group_amax, ragged_transpose


def te_segment_amax(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """TE's formulation: each row's amax, its group id by `jnp.repeat`, the max per group by `segment_max`."""
    row = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim)))
    ids = jnp.repeat(jnp.arange(group_sizes.size), group_sizes, total_repeat_length=x.shape[0])
    return jax.ops.segment_max(row, ids, num_segments=group_sizes.size)


@pytest.mark.parametrize("sizes", [[300, 0, 700, 128, 129, 500, 1, 290], [2048, 0, 0, 0, 0, 0, 0, 0], [256] * 8])
def test_group_amax_equals_segment_max(sizes: list[int]) -> None:
    x = (jax.random.normal(jax.random.key(0), (2048, 64), jnp.float32) * jnp.arange(1, 2049)[:, None]).astype(
        jnp.bfloat16
    )
    group_sizes = jnp.array(sizes, jnp.int32)
    ours = np.asarray(jax.jit(group_amax)(x, group_sizes))
    theirs = np.asarray(te_segment_amax(x, group_sizes), np.float32)
    full = np.array(sizes) > 0
    np.testing.assert_array_equal(ours[full], theirs[full])  # exact: a max is not rounded
    assert (ours[~full] == 0).all() and (theirs[~full] == -np.inf).all()  # both become scale 1 in TE's rule


def test_group_amax_without_sizes_is_per_row_and_compiles_without_scatter() -> None:
    w = jax.random.normal(jax.random.key(1), (8, 64, 32), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(group_amax(w, None)), np.abs(np.asarray(w, np.float32)).max(axis=(1, 2)))
    x = jax.random.normal(jax.random.key(2), (2048, 64), jnp.bfloat16)
    sizes = jnp.array([300, 0, 700, 128, 129, 500, 1, 290], jnp.int32)
    ours = jax.jit(group_amax).lower(x, sizes).compile().as_text()
    theirs = jax.jit(te_segment_amax).lower(x, sizes).compile().as_text()
    assert " scatter(" in theirs and " scatter(" not in ours


@pytest.mark.parametrize("sizes", [[48, 0, 16, 64, 32], [160], [0, 0, 160, 0]])
def test_ragged_transpose_lays_each_group_out_transposed(sizes: list[int]) -> None:
    """Each group's [m_g, n] rows become one [n, m_g] block, the blocks in group order: the column-wise layout
    TE's per-group GEMM reads (and its own quantize writes)."""
    q = jnp.arange(160 * 24, dtype=jnp.int32).reshape(160, 24)
    ours = np.asarray(jax.jit(ragged_transpose)(q, jnp.array(sizes, jnp.int32)))
    ends = np.cumsum(sizes)
    blocks = [np.asarray(q)[end - size : end].T.reshape(-1) for size, end in zip(sizes, ends, strict=True)]
    np.testing.assert_array_equal(ours, np.concatenate(blocks))


def test_install_switches_between_the_casts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`install` wraps TE's own function each time, never a wrapper of a wrapper, and keeps the one asked for."""
    own = lambda *args, **kwargs: "te's own"  # noqa: E731
    extensions = types.SimpleNamespace(grouped_quantize=own)
    quantize = types.SimpleNamespace(ScalingMode=types.SimpleNamespace(CURRENT_TENSOR_SCALING="current"))
    monkeypatch.setitem(sys.modules, te_group_scales.EXTENSIONS, extensions)
    monkeypatch.setitem(sys.modules, te_group_scales.QUANTIZE, quantize)
    for cast in ("te", "xla", "xla", "te"):
        te_group_scales.install(cast)
        assert extensions.grouped_quantize.cast == cast and extensions.grouped_quantize.wrapped is own
