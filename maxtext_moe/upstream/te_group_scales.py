"""TE's grouped FP8 quantize under current scaling, with each group's scale found without a scatter.

The gap: TE 2.20.2's `grouped_quantize` with current scaling finds each group's amax with `jnp.repeat` (a
scatter-add over every row, for the rows' group ids) and `jax.ops.segment_max` (a scatter-max of every row
into G slots). XLA fuses our permutation's gather and the rows' |x| max into that scatter, one thread per
row. On one H200 those fusions took 104-135 ms of some FP8 proxy steps and none of others, with the same
code (docs/PERFORMANCE.md). Rows reach TE sorted by group, so the same amax is a masked max over the rows:
one reduction, no atomics, and no scatter left in the step for XLA to fuse that way. TE's quantize takes
given per-group scales only through its delayed-scaling quantizers (the cast kernel is the same; the mode
says where the scales came from, and TE's grouped GEMM treats both tensor-scaling modes alike), so `install`
wraps `grouped_quantize`: for current scaling it computes the scales current scaling would (TE's own
`compute_scale_from_amax` on the same amax) and hands them to TE's quantize as delayed-scaling state. The
FP8 data and scales equal TE's current scaling (tests/gpu/test_te_group_scales_gpu.py); every other mode goes
to TE's function unchanged.

Process-wide once installed (TE's backward rules call `grouped_quantize` while JAX transposes the step, after
our layer's code has returned), which is harmless: values are unchanged for every caller.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

EXTENSIONS = "transformer_engine.jax.cpp_extensions"
QUANTIZE = "transformer_engine.jax.quantize"


def group_amax(x: jax.Array, group_sizes: jax.Array | None) -> jax.Array:
    """Each group's max |x| ([G], float32) over its rows of `x` ([M, ...]); `group_sizes=None` makes every row
    its own group (a [G, K, N] kernel). Empty groups and rows past the last group give 0, which TE's scale
    rule maps to scale 1, as it does the -inf of an empty `segment_max`."""
    row = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim))).astype(jnp.float32)
    if group_sizes is None:
        return row
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(x.shape[0])
    inside = (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])
    return jnp.max(jnp.where(inside, row[None, :], 0.0), axis=1)


def _scales_as_given(quantizer, amax: jax.Array):
    """A delayed-scaling grouped quantizer that carries current scaling's per-group scales for `amax`."""
    q = importlib.import_module(QUANTIZE)
    delayed = q.ScalingMode.DELAYED_TENSOR_SCALING
    per_group = tuple(
        q.DelayedScaleQuantizer(
            q_dtype=quantizer.q_dtype,
            scaling_mode=delayed,
            q_layout=quantizer.q_layout,
            data_layout=quantizer.data_layout,
            checkpoint_name=quantizer.checkpoint_name,
            scale=q.compute_scale_from_amax(amax[i : i + 1], quantizer.q_dtype, margin=0.0),
            amax_history=jnp.zeros((1,), jnp.float32),
        )
        for i in range(amax.shape[0])
    )
    return q.GroupedQuantizer(
        q_dtype=quantizer.q_dtype,
        scaling_mode=delayed,
        q_layout=quantizer.q_layout,
        data_layout=quantizer.data_layout,
        checkpoint_name=quantizer.checkpoint_name,
        n_groups=amax.shape[0],
        quantizers=per_group,
    )


def scatter_free(grouped_quantize: Callable) -> Callable:
    """`grouped_quantize` with current scaling's per-group amax taken by `group_amax`; other modes unchanged."""
    current = importlib.import_module(QUANTIZE).ScalingMode.CURRENT_TENSOR_SCALING

    def quantize(x, quantizer, group_sizes=None, flatten_axis=-1):
        if quantizer is None or quantizer.scaling_mode != current or not isinstance(x, jax.Array):
            return grouped_quantize(x, quantizer, group_sizes, flatten_axis)
        return grouped_quantize(x, _scales_as_given(quantizer, group_amax(x, group_sizes)), group_sizes, flatten_axis)

    quantize.wrapped = grouped_quantize
    return quantize


def install() -> None:
    """Route TE's grouped current-scaling quantize through `scatter_free`, once per process."""
    extensions = importlib.import_module(EXTENSIONS)
    if not hasattr(extensions.grouped_quantize, "wrapped"):
        extensions.grouped_quantize = scatter_free(extensions.grouped_quantize)
