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
from maxtext_moe.moe.layer import Params, expert_mlp_on_copies, sort_by_expert
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
    float32, number of valid (row, expert) copies), the experts computing as `path` says. Empty slots (-1,
    or out of this rank's [0, L)) sort after the L expert groups and are zeroed before the sum.

    The grouped GEMMs run on the first `copies_cap` sorted copies (all M * S when None): the valid ones,
    then empty ones up to the cap, which the GEMMs treat as rows past the groups (`grouped_matmul(partial=
    True)`): tokamax skips them, TE computes them (it needs groups that cover every row). Why the cap: the
    dropless worst case is M * S copies, twice what a rank holds on average at EP2 and eight times at EP8,
    and TE would spend that many rows of GEMM work. The caller guarantees the valid copies fit
    (`ep_routed` stops the step otherwise); copies past the cap would be lost."""
    rows, slots = row_experts.shape
    num_local = experts["wi_0"].shape[0]
    flat = row_experts.reshape(-1)
    valid = (flat >= 0) & (flat < num_local)
    order, inverse, sizes = sort_by_expert(jnp.where(valid, flat, num_local), num_local + 1, check=False)
    sizes = sizes[:num_local]
    cap = flat.shape[0] if copies_cap is None else min(copies_cap, flat.shape[0])
    order, inverse = order[:cap], jnp.where(inverse < cap, inverse, cap)  # index cap: a copy left out
    out = expert_mlp_on_copies(jnp.repeat(x, slots, axis=0), order, inverse, sizes, experts, path, partial=True)
    out = jnp.where(valid[:, None], out, 0).reshape(rows, slots, -1)
    y = jnp.einsum("msd,ms->md", out, row_weights.astype(x.dtype), preferred_element_type=jnp.float32)
    return y, jnp.sum(valid, dtype=jnp.int32)


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
