"""Pad each expert group of sorted rows to a multiple of `align` rows, and drop the padding afterwards.

Why: TE's FP8 grouped GEMM on Hopper (per-group "V1" path, current scaling) asserts that every group's
row count is a multiple of 16 (`CanonicalizeGemmInput: ... lda % 16 == 0`), and the
padding rows must be counted inside `group_sizes`. TE's own permutation `align_size` leaves them outside,
which that path rejects. So the padding is done here, as zero rows at the end of each group: the GEMM of a
zero row is a zero row, which `unpad_rows` drops, so no token is dropped and the result is unchanged.

No group is left empty: one with no rows gets `align` zero rows. TE 2.20.2's per-group FP8 GEMM skips an
empty group's scale on the row side (its quantize stores scales for the non-empty groups only) but not on the
weight side (every expert's weights have a scale), so each expert after an empty one would run with its
neighbour's weight scale (tests/gpu/test_moe_gpu.py checks each expert's output around an empty one).

Shapes are static (jit): the padded buffer has `padded_rows(M, G, align)` rows, the worst case
M + G * align rounded up to a multiple of `align`. The slack rows beyond the aligned groups are
counted in the last group, so the padded sizes sum to exactly the buffer's rows (what TE's own permutation
hands its grouped GEMM) and every size stays a multiple of `align`. Rows of `x` after the last group (the
expert-parallel receive side sorts its empty slots there) are left out, and come back as zeros.

Both directions are gathers, and so are their gradients: padding and unpadding are partial bijections
between the M rows and the padded rows, and the transpose of a gather by a one-to-one map is the gather by
its inverse (no scatter-add).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class GroupAlignment(NamedTuple):
    """Index maps between M sorted rows and their padded layout (a pytree: passes through jit)."""

    group_sizes: jax.Array  # [G] int32: padded sizes, multiples of `align`, summing to the padded rows
    src: jax.Array  # [P] int32: the row of x each padded row holds; M (out of range) for a zero row
    dest: jax.Array  # [M] int32: the padded row each row of x goes to; P for rows outside every group


def padded_rows(rows: int, groups: int, align: int) -> int:
    """Static size of the padded buffer: the worst case `rows + groups * align` (a group of one row or none
    takes `align`), rounded up to `align`."""
    return -(-(rows + groups * align) // align) * align


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group of each of `rows` rows sorted by group ([rows] int32; rows past the groups: the last).

    The search compares every row with the G group ends (one fused pass): JAX's default binary search is a loop
    over every row. G is an expert count, small."""
    g = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(rows), side="right", method="compare_all")
    return jnp.minimum(g, group_sizes.shape[0] - 1).astype(jnp.int32)


def align_groups(group_sizes: jax.Array, rows: int, align: int) -> GroupAlignment:
    """The padded layout of `rows` rows sorted by group with sizes `group_sizes` [G] (sum <= rows)."""
    if align < 1:
        raise ValueError(f"align must be at least 1, got {align}")
    sizes = group_sizes.astype(jnp.int32)
    groups = sizes.shape[0]
    total = padded_rows(rows, groups, align)
    aligned = jnp.maximum((sizes + align - 1) // align * align, align)
    aligned = aligned.at[-1].add(total - jnp.sum(aligned))  # the slack joins the last group (a multiple of align)
    starts = jnp.cumsum(sizes) - sizes
    padded_starts = jnp.cumsum(aligned) - aligned

    row = jnp.arange(rows, dtype=jnp.int32)
    g = row_groups(sizes, rows)
    inside = row < jnp.sum(sizes)
    dest = jnp.where(inside, padded_starts[g] + row - starts[g], total)

    slot = jnp.arange(total, dtype=jnp.int32)
    pg = row_groups(aligned, total)  # every slot is inside: the aligned sizes sum to `total`
    offset = slot - padded_starts[pg]
    src = jnp.where(offset < sizes[pg], starts[pg] + offset, rows)
    return GroupAlignment(aligned, src.astype(jnp.int32), dest.astype(jnp.int32))


def compose(order: jax.Array, inverse: jax.Array, a: GroupAlignment) -> tuple[jax.Array, jax.Array]:
    """A sort followed by the padding `a` of the sorted rows, as one pair of gather maps, so the rows are
    copied once instead of twice each way (`take_rows(x, index, back)` and back, with fill).

    `order` [R]: the row of x each sorted row holds; `inverse` [N]: each row's sorted position, R for a
    row left out of the sort (a partial sort keeps only R of the N rows). Returns `index` [P]: the row of
    x each padded row holds, N for a zero row; `back` [N]: each row's padded position, P for a row left out.
    """
    kept, total = order.shape[0], a.src.shape[0]
    index = jnp.where(a.src < kept, order[jnp.minimum(a.src, kept - 1)], inverse.shape[0])
    back = jnp.append(a.dest, jnp.int32(total))[inverse]
    return index.astype(jnp.int32), back.astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def take_rows(x: jax.Array, index: jax.Array, inverse: jax.Array, fill: bool = True) -> jax.Array:
    """x[index] whose gradient is the gather by `inverse` (the transpose of a gather by a one-to-one map),
    not the scatter-add XLA would emit. The one row gather of the MoE code: sorting copies by expert,
    unsorting, padding groups, and keeping part of the EP receive side's copies.

    `fill`: `index` and `inverse` may be partial maps onto part of the rows, in either direction; an index
    past the last row reads zero, forward and backward. Without it every index is promised in bounds (a
    full permutation), and the gather needs no fill.
    """
    return _gather(x, index, fill)


def _gather(x: jax.Array, index: jax.Array, fill: bool) -> jax.Array:
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0) if fill else x[index]


def _take_rows_fwd(x: jax.Array, index: jax.Array, inverse: jax.Array, fill: bool) -> tuple[jax.Array, jax.Array]:
    return _gather(x, index, fill), inverse


def _take_rows_bwd(fill: bool, inverse: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    return _gather(g, inverse, fill), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def pad_rows(x: jax.Array, a: GroupAlignment) -> jax.Array:
    """[M, ...] rows sorted by group -> [P, ...] with each group padded by zero rows to `a.group_sizes`."""
    return take_rows(x, a.src, a.dest)


def unpad_rows(y: jax.Array, a: GroupAlignment) -> jax.Array:
    """[P, ...] padded rows (e.g. a grouped GEMM's output) -> [M, ...] in the original order, padding dropped."""
    return take_rows(y, a.dest, a.src)


def aligned(
    gemm: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    x_sorted: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    align: int,
) -> jax.Array:
    """`gemm(x, w, group_sizes)` run on the rows padded to `align` per group, its output unpadded: the same
    [M, N] result as on the unpadded rows, for a grouped GEMM that needs aligned groups."""
    a = align_groups(group_sizes, x_sorted.shape[0], align)
    return unpad_rows(gemm(pad_rows(x_sorted, a), w, a.group_sizes), a)
