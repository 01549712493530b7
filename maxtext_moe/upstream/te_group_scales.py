"""TE's grouped FP8 quantize under current scaling, done by XLA, with each group's scale found without a scatter.

The gaps, in TE 2.20.2's `grouped_quantize` (the per-group path its Hopper FP8 grouped GEMM takes):
- Its C++ call copies the group sizes to the host and synchronises the stream, then launches one cast kernel
  per group: the GPU runs dry at each cast of an expert layer (four forward, two backward).
- It finds each group's amax with `jnp.repeat` (a scatter-add over every row, for the rows' group ids) and
  `jax.ops.segment_max` (a scatter-max of every row into G slots). XLA fuses our permutation's gather and the
  rows' |x| max into that scatter, one thread per row. On one H200 those fusions took 104-135 ms of some FP8
  proxy steps and none of others, with the same code (docs/PERFORMANCE.md).
Rows reach TE sorted by group, so the amax is a masked max over the rows (`group_amax`: one reduction, no
atomics), and the cast is elementwise: `xla_cast` computes the scales TE's current scaling would (TE's own
`compute_scale_from_amax`), casts the rows with them, and lays out the column-wise copy as TE's quantize does
(each group's rows transposed, `ragged_transpose`), as arrays XLA schedules with the rest of the step, no
host round trip; it hands TE's grouped GEMM the same FP8 bytes and scales as TE's quantize
(tests/gpu/test_te_group_scales_gpu.py). Tensors of 2^31 elements or more (past the uint32 arithmetic of the
layout) go to TE's cast with the scatter-free scales (`scatter_free`), handed to TE through its
delayed-scaling quantizers (the cast kernel is the same; TE's grouped GEMM treats both tensor-scaling modes
alike). Every other mode goes to TE's function unchanged.

Process-wide once installed (TE's backward rules call `grouped_quantize` while JAX transposes the step, after
our layer's code has returned), which is harmless: values are unchanged for every caller. A run asks for one
cast (`moe.fp8_cast`); `install` with another replaces the wrapper.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_moe.moe.align import row_groups
from maxtext_moe.moe.settings import Fp8Cast

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


def ragged_transpose(q: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """[M, n] rows sorted by group -> [M * n]: each group's [m_g, n] block transposed to [n, m_g], the blocks one
    after another (the column-wise layout TE's per-group GEMM reads for a weight gradient).

    One plain transpose, then a gather whose reads run along the transposed rows: output element l of group g
    (its block starting at row s) is the transpose's element (l // m_g, s + l % m_g). Index arithmetic is uint32
    (`xla_cast` sends tensors of 2^31 elements or more to TE's cast)."""
    m, n = q.shape
    g = row_groups(group_sizes, m)
    sizes = group_sizes.astype(jnp.uint32)
    start = (jnp.cumsum(sizes) - sizes)[g][:, None]
    size = jnp.maximum(sizes[g], 1)[:, None]
    local = (jax.lax.broadcasted_iota(jnp.uint32, (m, n), 0) - start) * n + jax.lax.broadcasted_iota(
        jnp.uint32, (m, n), 1
    )
    # source (k, s + l - k * m_g) of the [n, M] transpose, flattened with k read once, so that XLA computes
    # the indices inside the gather's kernel instead of writing them out
    source = local // size * (m - size) + start + local
    qt = jax.lax.optimization_barrier(q.T)  # a transpose kernel of its own, not strided reads inside the gather
    return qt.reshape(-1).at[source.reshape(-1)].get(mode="promise_in_bounds", unique_indices=True)


def _cast(x: jax.Array, quantizer, group_sizes: jax.Array | None, flatten_axis: int):
    """Current scaling's cast of `x` by XLA, in the layout TE's quantize writes."""
    q = importlib.import_module(QUANTIZE)
    axis = flatten_axis % x.ndim
    m = x.size // int(np.prod(x.shape[axis:]))
    amax = group_amax(x, group_sizes)
    scale = jnp.concatenate(
        [q.compute_scale_from_amax(amax[i : i + 1], quantizer.q_dtype, margin=0.0) for i in range(amax.shape[0])]
    )
    groups = amax.shape[0]
    row_scale = jnp.repeat(scale, m // groups) if group_sizes is None else scale[row_groups(group_sizes, m)]
    top = float(jnp.finfo(quantizer.q_dtype).max)
    rows = x.reshape(m, -1).astype(jnp.float32) * row_scale[:, None]
    data = jnp.clip(rows, -top, top).astype(quantizer.q_dtype)
    if group_sizes is None:
        colwise = jnp.swapaxes(data.reshape(groups, m // groups, -1), 1, 2).reshape(-1)
        scale_inv = 1.0 / scale
    else:
        colwise = ragged_transpose(data, group_sizes)
        # TE's quantize stores the scales of the non-empty groups only, in order, and its GEMM reads them so
        scale_inv = (1.0 / scale)[jnp.argsort(group_sizes == 0, stable=True)]
    layout = quantizer.q_layout
    return q.ScaledTensorFactory.create(
        data=data.reshape(-1) if layout.has_rowwise else jnp.zeros((1,), quantizer.q_dtype),
        scale_inv=scale_inv,
        colwise_data=colwise if layout.has_colwise else jnp.zeros((1,), quantizer.q_dtype),
        colwise_scale_inv=scale_inv,
        scaling_mode=quantizer.scaling_mode,
        dq_dtype=x.dtype,
        q_layout=layout,
        data_layout=quantizer.get_data_layout(),
        flatten_axis=flatten_axis,
        first_dims=group_sizes,
        original_shape=x.shape,
    )


def _by_xla(x, quantizer) -> bool:
    """Whether XLA can cast `x` for `quantizer`: current scaling, and under 2^31 elements (the uint32
    arithmetic of `ragged_transpose`)."""
    current = importlib.import_module(QUANTIZE).ScalingMode.CURRENT_TENSOR_SCALING
    return quantizer is not None and quantizer.scaling_mode == current and isinstance(x, jax.Array) and x.size < 2**31


def xla_cast(grouped_quantize: Callable) -> Callable:
    """`grouped_quantize` with current scaling done by XLA; tensors of 2^31 elements or more go to TE's cast
    with `scatter_free` scales, other modes to TE's function unchanged."""
    large = scatter_free(grouped_quantize)

    def quantize(x, quantizer, group_sizes=None, flatten_axis=-1):
        if not _by_xla(x, quantizer):
            return large(x, quantizer, group_sizes, flatten_axis)
        return _cast(x, quantizer, group_sizes, flatten_axis)

    quantize.wrapped = grouped_quantize
    return quantize


def install(cast: Fp8Cast = "te") -> None:
    """Route TE's grouped current-scaling quantize through `xla_cast` (`cast` "xla") or `scatter_free` ("te"),
    from now on in this process."""
    extensions = importlib.import_module(EXTENSIONS)
    current = extensions.grouped_quantize
    if getattr(current, "cast", None) != cast:
        wrap = {"xla": xla_cast, "te": scatter_free}[cast]
        extensions.grouped_quantize = wrap(getattr(current, "wrapped", current))
        extensions.grouped_quantize.cast = cast
