"""The receive side of an expert-parallel step: buffer sizes, expert copies, and the capacity guard.

Receive buffers: by default (`buffer_factor` <= 0) each rank's receive buffer has the dropless worst case,
R * peer_rows rows (R * T with dedup), which at DeepSeek-V3 scale is far more than a rank receives. With
`buffer_factor` > 0 it has `receive_rows` = ceil(factor * balanced) rows, balanced being what a rank
receives when every token sends its most rows (min(k, R) with dedup, k without) spread evenly over the
ranks: MaxText's `ragged_buffer_factor` meaning, counted in our rows. Rows from the senders are packed
one after another, so the bound is on the rank's total; should a batch need more, the exchange never
writes past the buffer and `guard_capacity` stops the step instead of dropping rows silently. The same
factor bounds the (row, expert) copies a rank's grouped GEMMs run (`expert_copies`: factor * T * k, where
the worst case is R * T * min(k, L)), with the same guard: TE computes every copy it is given, so at EP R
the worst case would cost R times the balanced expert GEMM rows.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_moe.errors import UserError
from maxtext_moe.moe import scopes
from maxtext_moe.moe.align import take_rows
from maxtext_moe.moe.layer import Params, expert_mlp, sort_by_expert, sorted_copies
from maxtext_moe.moe.send_plan import DispatchPlan
from maxtext_moe.moe.settings import ExpertPath


def expand_reduce(
    x: jax.Array,
    row_experts: jax.Array,
    row_weights: jax.Array,
    experts: Params,
    path: ExpertPath,
    copies_cap: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Receive side: rows [M, D] with slots [M, S] -> (weighted sum of their local experts' outputs [M, D]
    in x's dtype, summed in float32, number of valid (row, expert) copies), the experts computing as `path`
    says. Empty slots (-1, or out of this rank's [0, L)) sort after the L expert groups and add nothing.

    The grouped GEMMs run on the first `copies_cap` sorted copies (all M * S when None): the valid ones,
    then empty ones up to the cap, which the GEMMs treat as rows past the groups (`grouped_matmul(partial=
    True)`): tokamax skips them, TE computes them (it needs groups that cover every row). Why the cap: the
    dropless worst case is M * S copies, twice what a rank holds on average at EP2 and eight times at EP8,
    and TE would spend that many rows of GEMM work. The caller guarantees the valid copies fit
    (`ep_routed` stops the step otherwise); copies past the cap would be lost.

    Each sorted copy reads its received row, and each row sums its slots' outputs; both directions, and their
    gradients, are gathers by the slot -> copy map (`_spread`, `_combine`), so no buffer has a row for every
    one of the M * S slots and nothing is summed by a scatter. At EP8 most slots are empty, and such a buffer
    took 14 GiB of the 671B H100 recipe's step.
    """
    rows, slots = row_experts.shape
    num_local = experts["wo"].shape[0]
    flat = row_experts.reshape(-1)
    valid = (flat >= 0) & (flat < num_local)
    order, inverse, sizes = sort_by_expert(jnp.where(valid, flat, num_local), num_local + 1, check=False)
    sizes = sizes[:num_local]
    cap = flat.shape[0] if copies_cap is None else min(copies_cap, flat.shape[0])
    order, inverse = order[:cap], jnp.where(inverse < cap, inverse, cap)  # index cap: a copy left out
    s = sorted_copies(order, inverse, sizes, path, partial=True)
    copies = s.index.shape[0]
    src = s.index // slots  # the received row of each sorted copy; `rows` (past the end) for a padding row
    back = jnp.where(valid, s.back, copies).reshape(rows, slots)  # each slot's sorted copy; `copies` if none
    weight = take_rows(row_weights.reshape(-1).astype(jnp.float32), s.index, back.reshape(-1))  # 0 for padding
    with jax.named_scope(scopes.PERMUTE):
        x_sorted = _spread(x, src, back)
    out = expert_mlp(
        x_sorted, experts, s.group_sizes, path, partial=s.partial, groups_aligned=s.aligned, row_weights=weight
    )
    with jax.named_scope(scopes.UNPERMUTE):
        y = _combine(out, back, src)
    return y, jnp.sum(valid, dtype=jnp.int32)


def _rows_of_slots(a: jax.Array, back: jax.Array) -> jax.Array:
    """a[back] for slots `back` [M, S] into the rows of `a` [P, ...]: zero where a slot has none (index P)."""
    return jnp.take(a, back, axis=0, mode="fill", fill_value=0)


@jax.custom_vjp
def _spread(x: jax.Array, src: jax.Array, back: jax.Array) -> jax.Array:
    """x[src]: each sorted copy's received row [P, D] (zero for `src` past the rows). Its gradient sums each
    row's copies, found through `back` [M, S], in float32: a gather, where autodiff would scatter-add."""
    return jnp.take(x, src, axis=0, mode="fill", fill_value=0)


def _spread_fwd(x: jax.Array, src: jax.Array, back: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _spread(x, src, back), back


def _spread_bwd(back: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    return jnp.sum(_rows_of_slots(g, back).astype(jnp.float32), axis=1).astype(g.dtype), None, None


_spread.defvjp(_spread_fwd, _spread_bwd)


@jax.custom_vjp
def _combine(out: jax.Array, back: jax.Array, src: jax.Array) -> jax.Array:
    """Each received row's sum of its copies' outputs [M, D] (already weighted: `expert_mlp` applies the
    routing weights before wo), in float32, returned in out's dtype: out [P, D] by copy, `back` [M, S] each
    slot's copy. The gradient is a gather by `src`, and keeps no output of the forward pass."""
    return jnp.sum(_rows_of_slots(out, back).astype(jnp.float32), axis=1).astype(out.dtype)


def _combine_fwd(out: jax.Array, back: jax.Array, src: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _combine(out, back, src), src


def _combine_bwd(src: jax.Array, g: jax.Array) -> tuple[jax.Array, None, None]:
    return jnp.take(g, src, axis=0, mode="fill", fill_value=0), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def receive_rows(plan: DispatchPlan, buffer_factor: float) -> int:
    """Rows of each rank's receive buffer: the worst case R * peer_rows when `buffer_factor` <= 0, else
    ceil(factor * balanced), capped at the worst case. Balanced is the N send rows of one source (every
    token sending its most rows): spread evenly, R sources send a rank N/R rows each. Without dedup this is
    exactly MaxText's `ragged_buffer_factor` buffer (factor * T * k)."""
    worst = plan.send_counts.shape[0] * plan.peer_rows
    if buffer_factor <= 0:
        return worst
    return min(worst, math.ceil(buffer_factor * plan.row_token.shape[0]))


def expert_copies(plan: DispatchPlan, tokens: int, buffer_factor: float) -> int | None:
    """(row, expert) copies each rank's grouped GEMMs run: None (every slot of the receive buffer, the
    dropless worst case) when `buffer_factor` <= 0, else ceil(factor * T * k), T * k being what a rank
    serves when the R * T * k copies of all ranks spread evenly: MaxText's `ragged_buffer_factor` buffer."""
    return None if buffer_factor <= 0 else math.ceil(buffer_factor * tokens * plan.top_k)


def _raise_overflow(needed: np.ndarray, capacity: int, buffer_factor: float, what: str) -> None:
    raise UserError(
        f"EP receive buffer overflow: a rank needs {int(needed)} {what} but its buffer holds {capacity} "
        f"(ragged_buffer_factor={buffer_factor}); no row was dropped: this step is stopped instead.",
        key="ragged_buffer_factor",
        fix="raise ragged_buffer_factor, or set it to -1 for the dropless worst-case buffer.",
    )


def guard_capacity(needed: jax.Array, capacity: int, buffer_factor: float, what: str) -> None:
    """Stop the step when some rank needs more than `capacity`. `needed` is the most any rank needs, the
    same value on every rank, so every rank takes the same branch; the host callback runs only when the
    buffer overflows, the common step pays one predicate read."""
    jax.lax.cond(
        needed > capacity,
        lambda n: jax.debug.callback(
            functools.partial(_raise_overflow, capacity=capacity, buffer_factor=buffer_factor, what=what), n
        ),
        lambda n: None,
        needed,
    )
