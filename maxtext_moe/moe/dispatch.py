"""Expert-parallel (EP) dispatch and combine with per-destination-rank deduplication.

Why our own: MaxText 0.2.5's EP path (`layers/moe.py`, `sparse_matmul=true`) sends a token once per chosen
expert through `jax.lax.ragged_all_to_all`, so a token whose top-k experts share a rank crosses the
network several times, and `ragged_all_to_all` has no XLA:CPU implementation, so that bookkeeping cannot
be tested off-GPU. Here a token goes to each destination rank ONCE, carrying the list of its local experts
there and their combine weights; the destination expands the row to those experts, runs the grouped GEMMs,
reduces the weighted outputs, and sends ONE row back; the source adds the per-rank partial sums.

Layout: R ranks on one mesh axis; rank r holds experts [r*L, (r+1)*L), L = E/R, and its own slice of the
tokens. Everything is a pure function of arrays, with static shapes sized for the dropless worst case:
  `plan_dispatch`  per source rank: send counts per destination, the order of the rows to send, and per
                   row the local experts (k slots at most, padded with -1) and weights (padded with 0).
  `exchange`       one ragged all-to-all, three implementations: "all_to_all" (XLA's dense all-to-all of
                   fixed per-destination blocks: every backend, any number of processes), "ragged_all_to_all"
                   (`jax.lax.ragged_all_to_all`: GPUs only) and "emulated" (`all_gather` + gathers: the
                   reference, also under `vmap`).
  `expand_reduce`  receive side: one copy per (row, local expert), grouped GEMMs, weighted sum per row.
  `ep_routed`      the routed part on one rank: plan -> exchange -> expand/reduce -> exchange back -> sum.
Drivers: `ep_moe_forward_emulated` (ranks on an explicit leading axis through `vmap`: the CPU reference),
`ep_routed_sharded` (the routed experts under `shard_map` over any mesh with an expert axis: what
`integration.py` runs inside MaxText's decoder) and `ep_moe_forward_sharded` (it plus the shared expert).

Receive buffers: by default (`buffer_factor` <= 0) each rank's receive buffer has the dropless worst case,
R * peer_rows rows (R * T with dedup), which at DeepSeek-V3 scale is far more than a rank receives. With
`buffer_factor` > 0 it has `receive_rows` = ceil(factor * balanced) rows, balanced being what a rank
receives when every token sends its most rows (min(k, R) with dedup, k without) spread evenly over the
ranks: MaxText's `ragged_buffer_factor` meaning, counted in our rows. Rows from the senders are packed
one after another, so the bound is on the rank's total; should a batch need more, the exchange never
writes past the buffer and a guard raises (`_guard_capacity`) instead of dropping rows silently. The same
factor bounds the (row, expert) copies a rank's grouped GEMMs run (`expert_copies`: factor * T * k, where
the worst case is R * T * min(k, L)), with the same guard: at EP2 the worst case doubles the expert GEMM
rows TE computes, at EP8 it is eight times.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.errors import UserError
from maxtext_moe.moe.gemm import Backend, Fp8
from maxtext_moe.moe.layer import (
    MoEConfig,
    Params,
    expert_mlp,
    gate_logits,
    permute_rows,
    shared_expert,
    sort_by_expert,
)
from maxtext_moe.moe.routing import Routing, route

Impl = Literal["all_to_all", "ragged_all_to_all", "emulated"]
IMPLS: tuple[Impl, ...] = ("all_to_all", "ragged_all_to_all", "emulated")
EP_AXIS = "expert"  # MaxText's name for the expert-parallel mesh axis


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["send_counts", "send_offsets", "row_token", "row_experts", "row_weights"],
    meta_fields=["top_k", "peer_rows"],
)
@dataclasses.dataclass(frozen=True)
class DispatchPlan:
    """What one source rank sends. N send rows, grouped by destination rank in rank order, padding last.

    send_counts  [R] int32  rows for each destination rank
    send_offsets [R] int32  first row of each destination in the send buffer (exclusive cumsum)
    row_token    [N] int32  source token of each row (0 on padding rows, which are never sent)
    row_experts  [N, S]     the destination's local expert index per slot, -1 on an empty slot
    row_weights  [N, S]     combine weight per slot, 0 on an empty slot
    top_k        static     experts per token (the dropless check expects tokens * top_k copies)
    peer_rows    static     most rows one source can send one destination: the worst-case receive
                            buffer holds R * peer_rows rows (T with dedup; T * min(k, L) without)
    """

    send_counts: jax.Array
    send_offsets: jax.Array
    row_token: jax.Array
    row_experts: jax.Array
    row_weights: jax.Array
    top_k: int
    peer_rows: int


def local_experts(num_experts: int, ranks: int) -> int:
    """Experts per rank, L = E / R; refuses a split that would leave ranks with different shards."""
    if ranks < 1 or num_experts % ranks:
        raise UserError(
            f"expert parallelism {ranks} does not divide num_experts={num_experts}.",
            fix="choose an expert-parallel size that divides the number of experts.",
        )
    return num_experts // ranks


def _raise_if_lost(total: np.ndarray, expected: int, where: str) -> None:
    if int(total) != expected:
        raise UserError(
            f"EP dispatch is not dropless: {where} holds {int(total)} (token, expert) copies, expected "
            f"{expected} (tokens x top-k); the dispatch plan is inconsistent or an expert index is "
            "outside [0, num_experts)."
        )


def _check_dropless(total: jax.Array, expected: int, where: str) -> None:
    """Eager when `total` is concrete, else a host callback (as `layer.sort_by_expert` does)."""
    if isinstance(total, jax.core.Tracer):
        jax.debug.callback(functools.partial(_raise_if_lost, expected=expected, where=where), total)
    else:
        _raise_if_lost(np.asarray(total), expected, where)


def peer_rows(tokens: int, top_k: int, num_local: int, dedup: bool) -> int:
    """Most rows one source sends one destination: a row per token with dedup, else one per (token, local
    expert). The worst-case receive buffer holds R of these; the "all_to_all" exchange sends R blocks of them."""
    return tokens if dedup else tokens * min(top_k, num_local)


def plan_dispatch(
    expert_ids: jax.Array, weights: jax.Array, num_experts: int, ranks: int, *, dedup: bool = True, check: bool = True
) -> DispatchPlan:
    """Plan one source rank's sends from its routing (`expert_ids`, `weights`: [T, k]).

    With `dedup`, a token sends one row to each rank holding any of its experts, with S = min(k, L) slots;
    rows are bounded by T per destination and T * min(k, R) in all. Without, every (token, expert) pair
    is its own row with one slot (MaxText's scheme): it is the dedup plan of the T*k copies as tokens.
    """
    tokens, k = expert_ids.shape
    num_local = local_experts(num_experts, ranks)
    if not dedup:
        copies = plan_dispatch(
            expert_ids.reshape(tokens * k, 1),
            weights.reshape(tokens * k, 1),
            num_experts,
            ranks,
            dedup=True,
            check=check,
        )
        return dataclasses.replace(
            copies, row_token=copies.row_token // k, top_k=k, peer_rows=peer_rows(tokens, k, num_local, dedup=False)
        )
    slots = min(k, num_local)
    hit = expert_ids[:, None, :] // num_local == jnp.arange(ranks)[None, :, None]  # [T, R, k]
    # For each (token, rank), the positions j of the token's experts on that rank, first S of them.
    slot_src = jnp.argsort(~hit, axis=-1, stable=True)[..., :slots]
    slot_ok = jnp.take_along_axis(hit, slot_src, axis=-1)
    pick = lambda a: jnp.take_along_axis(jnp.broadcast_to(a[:, None, :], hit.shape), slot_src, axis=-1)  # noqa: E731
    experts = jnp.where(slot_ok, pick(expert_ids % num_local), -1)
    wts = jnp.where(slot_ok, pick(weights), 0)

    on_rank = jnp.any(hit, axis=-1)  # [T, R]
    send_counts = jnp.sum(on_rank, axis=0, dtype=jnp.int32)
    key = jnp.where(on_rank.T, jnp.arange(ranks)[:, None], ranks).reshape(-1)  # rank-major, absent last
    rows = tokens * min(k, ranks)
    order = jnp.argsort(key, stable=True)[:rows]
    real = jnp.arange(rows) < jnp.sum(send_counts)
    by_rank = lambda a: a.transpose(1, 0, 2).reshape(ranks * tokens, slots)[order]  # noqa: E731
    plan = DispatchPlan(
        send_counts=send_counts,
        send_offsets=(jnp.cumsum(send_counts) - send_counts).astype(jnp.int32),
        row_token=jnp.where(real, order % tokens, 0).astype(jnp.int32),
        row_experts=jnp.where(real[:, None], by_rank(experts), -1).astype(jnp.int32),
        row_weights=jnp.where(real[:, None], by_rank(wts), 0),
        top_k=k,
        peer_rows=peer_rows(tokens, k, num_local, dedup=True),
    )
    if check:
        _check_dropless(jnp.sum(plan.row_experts >= 0), tokens * k, "the dispatch plan")
    return plan


def _transpose(v: jax.Array, axis_name: str) -> jax.Array:
    """[R] per rank -> [R] per rank with element s = rank s's element for me (counts, offsets).

    An all_gather of R*R int32 (what MaxText does for its group sizes), not `all_to_all`: under `vmap`,
    all_to_all of a value that is the same on every rank (not batched) returns the wrong shape in JAX 0.11.
    """
    return jax.lax.all_gather(v, axis_name)[:, jax.lax.axis_index(axis_name)]


def _received(
    output_rows: int, output_offsets: jax.Array, recv_sizes: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array]:
    """Which rows of my output buffer sender s writes ([R, output_rows] bool), and where its rows start
    ([R]): the receive side of one exchange, from the senders' `output_offsets` and my `recv_sizes`."""
    dst_off = _transpose(output_offsets, axis_name)  # where sender s's rows land in my output
    pos = jnp.arange(output_rows)
    return (pos >= dst_off[:, None]) & (pos < (dst_off + recv_sizes)[:, None]), dst_off


def _emulated_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
) -> jax.Array:
    """`ragged_all_to_all` from all_gather + gathers: every rank sees all senders' buffers on an explicit
    leading ranks axis and picks its rows. R times the traffic: a reference for the bookkeeping, not a path
    to train on. `send_sizes` enters through its transpose, which by contract equals `recv_sizes`."""
    del send_sizes  # the receiver's view of it is recv_sizes
    senders = jax.lax.all_gather(operand, axis_name)  # [R, N, ...]
    src_off = _transpose(input_offsets, axis_name)  # where sender s's rows for me start in its buffer
    inside, dst_off = _received(output.shape[0], output_offsets, recv_sizes, axis_name)
    sender = jnp.argmax(inside, axis=0)
    row = jnp.clip(src_off[sender] + jnp.arange(output.shape[0]) - dst_off[sender], 0, operand.shape[0] - 1)
    got = jnp.any(inside, axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(got, senders[sender, row], output)


def _dense_ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
    block: int,
) -> jax.Array:
    """`ragged_all_to_all` over XLA's plain all-to-all: each destination's rows go in a block of `block`
    rows (at least every send size), the blocks cross in one all-to-all, and each receiver scatters the
    rows that arrived into its output. It sends R * block rows, padding included.

    Why: on two H200s with one process per GPU, XLA's ragged all-to-all between processes never completed
    a step, and its decomposer (`xla_gpu_unsupported_enable_ragged_all_to_all_decomposer`) trains but sends
    R blocks of the whole operand to every peer. The plain all-to-all is NCCL's own collective, and XLA:CPU
    implements it too, so this path runs in the CPU tests as it does on GPUs. With dedup a destination
    gets at most T rows from a source, so `block` = T: EP - 1 rows per token on the wire. At EP2 a token
    nearly always needs the other rank, so that is what dedup sends anyway; at EP8 it is as much as
    MaxText's once-per-expert volume (a token reaches about 5.3 of 8 ranks; docs/PLAN.md), so there the
    saving stays in the plan until blocks are sized from the routing or the ragged exchange runs."""
    ranks, j = input_offsets.shape[0], jnp.arange(block)
    src = jnp.clip(input_offsets[:, None] + j, 0, operand.shape[0] - 1)  # [R, block] rows for destination d
    mask = (j < send_sizes[:, None]).reshape(ranks, block, *([1] * (operand.ndim - 1)))
    blocks = jnp.where(mask, operand[src], 0)
    got = jax.lax.all_to_all(blocks, axis_name, 0, 0)  # got[s] = sender s's block for me
    dst = _transpose(output_offsets, axis_name)[:, None] + j  # where sender s's row j lands in my output
    dst = jnp.where(j < recv_sizes[:, None], dst, output.shape[0])  # rows past a sender's size are dropped
    return output.at[dst.reshape(-1)].set(got.reshape(ranks * block, *operand.shape[1:]), mode="drop")


def _ragged_exchange(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axis_name: str,
    impl: Impl,
    block: int,
) -> jax.Array:
    if impl == "all_to_all":
        return _dense_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, block
        )
    if impl == "ragged_all_to_all":
        # The collective's result takes the output buffer's type; a fresh buffer is the same on every rank,
        # while the rows arriving are not: mark it varying, or shard_map's checks reject our adjoint.
        output = jax.lax.pcast(output, axis_name, to="varying")
        return jax.lax.ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis_name
        )
    if impl == "emulated":
        return _emulated_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name
        )
    raise UserError(f"unknown EP exchange {impl!r}.", fix=f"use one of {', '.join(IMPLS)}.")


def _exchange_into_fresh_buffer(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    rows: int,
    pad: float,
    axis_name: str,
    impl: Impl,
    block: int,
) -> jax.Array:
    output = jnp.full((rows, *operand.shape[1:]), pad, operand.dtype)
    return _ragged_exchange(
        operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name, impl, block
    )


_differentiable_exchange = jax.custom_vjp(_exchange_into_fresh_buffer, nondiff_argnums=(5, 6, 7, 8, 9))


def _exchange_fwd(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    rows: int,
    pad: float,
    axis_name: str,
    impl: Impl,
    block: int,
) -> tuple[jax.Array, tuple]:
    out = _exchange_into_fresh_buffer(
        operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, pad, axis_name, impl, block
    )
    operand_rows = jnp.zeros((operand.shape[0], 0), operand.dtype)  # carries the operand's row count
    return out, (input_offsets, send_sizes, output_offsets, recv_sizes, operand_rows)


def _exchange_bwd(rows: int, pad: float, axis_name: str, impl: Impl, block: int, res: tuple, g: jax.Array) -> tuple:
    """The adjoint: each rank sends the cotangent rows of what it received back to where they came from,
    sizes and offsets swapped, exactly as the combine sends results back. The padding is a constant."""
    input_offsets, send_sizes, output_offsets, recv_sizes, operand_rows = res
    back = jnp.zeros((operand_rows.shape[0], *g.shape[1:]), g.dtype)
    operand_t = _ragged_exchange(
        g,
        back,
        _transpose(output_offsets, axis_name),
        recv_sizes,
        _transpose(input_offsets, axis_name),
        send_sizes,
        axis_name,
        impl,
        block,
    )
    return operand_t, None, None, None, None


_differentiable_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(
    operand: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    rows: int,
    pad: float = 0,
    axis_name: str,
    impl: Impl,
    block: int,
    own_adjoint: bool = True,
) -> jax.Array:
    """One ragged all-to-all over `axis_name` into a fresh buffer of `rows` rows filled with `pad`; offsets
    and sizes mean what they mean for `jax.lax.ragged_all_to_all`; no send size exceeds `block` rows.

    Call it per rank (inside `shard_map`, or inside `vmap(axis_name=...)` for "emulated"). "all_to_all"
    (`_dense_ragged_all_to_all`) and "emulated" run anywhere; "ragged_all_to_all" is XLA's collective (GPU;
    XLA:CPU does not implement it).
    Gradients use our own adjoint (`_exchange_bwd`: the same exchange run backwards, as the combine runs),
    which on two H200s gives the emulation's gradients for the whole EP layer (tests/test_moe_dispatch.py).
    Why not JAX 0.11.2's transpose of `ragged_all_to_all`: our first GPU run through it (with the output
    buffer typed as the same on every rank, under shard_map's checks) gave a gate-kernel gradient 1.85
    (relative) away from the emulation's while the outputs agreed. Alone, on one exchange without those
    checks, JAX's transpose agreed exactly; which of the two caused the miss is not isolated, so the layer
    keeps the adjoint that was verified. Integer operands (expert ids) have nothing to differentiate and skip
    the rule, as does `own_adjoint=False`, which `vmap` drivers need (a custom VJP's collectives lose the
    vmap axis name).
    """
    args = (operand, input_offsets, send_sizes, output_offsets, recv_sizes, rows, pad, axis_name, impl, block)
    if not own_adjoint or not jnp.issubdtype(operand.dtype, jnp.inexact):
        return _exchange_into_fresh_buffer(*args)
    return _differentiable_exchange(*args)


def expand_reduce(
    x: jax.Array,
    row_experts: jax.Array,
    row_weights: jax.Array,
    experts: Params,
    backend: Backend,
    fp8: Fp8 = "none",
    copies_cap: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Receive side: rows [M, D] with slots [M, S] -> (weighted sum of their local experts' outputs [M, D]
    float32, number of valid (row, expert) copies). Empty slots (-1, or out of this rank's [0, L)) sort
    after the L expert groups and are zeroed before the sum.

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
    part = cap < flat.shape[0]
    order, inverse = order[:cap], jnp.where(inverse < cap, inverse, cap)  # index cap: a copy left out
    x_sorted = permute_rows(jnp.repeat(x, slots, axis=0), order, inverse, part)
    out = permute_rows(expert_mlp(x_sorted, experts, sizes, backend, fp8, partial=True), inverse, order, part)
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


def _guard_capacity(needed: jax.Array, capacity: int, buffer_factor: float, what: str) -> None:
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


def ep_routed(
    x: jax.Array,
    plan: DispatchPlan,
    experts: Params,
    *,
    backend: Backend,
    impl: Impl,
    axis_name: str = EP_AXIS,
    check: bool = True,
    buffer_factor: float = -1.0,
    fp8: Fp8 = "none",
    own_adjoint: bool = True,
) -> jax.Array:
    """Routed-expert output [T, D] float32 for this rank's tokens `x` [T, D], its `plan`, and its expert
    shard `experts` ({wi_0, wi_1: [L, D, F], wo: [L, F, D]}). Runs per rank under shard_map or vmap.

    Send: row i of the send buffer is x[row_token[i]]; in each destination's receive buffer (`receive_rows`
    rows, pre-filled as padding: zeros, expert -1) the senders' rows follow one another in rank order.
    Return: each destination sends one reduced row per received row back to the position it came from; the
    source sums rows per token (`own_adjoint`: see `exchange`). With a capped buffer (`buffer_factor` > 0)
    rows past the end are never sent, the grouped GEMMs run `expert_copies` copies, and `_guard_capacity`
    stops the step when either bound is short; the `check` of copies still counts every (token, expert) pair.
    """
    ranks = plan.send_counts.shape[0]
    capacity = receive_rows(plan, buffer_factor)
    me = jax.lax.axis_index(axis_name)
    counts = jax.lax.all_gather(plan.send_counts, axis_name)  # [source, destination]
    landing = jnp.cumsum(counts, axis=0) - counts  # where source s's rows start in destination d's buffer
    if capacity < ranks * plan.peer_rows:
        _guard_capacity(jnp.max(jnp.sum(counts, axis=0)), capacity, buffer_factor, "rows")
    fits = jnp.clip(capacity - landing, 0, counts)  # never write past a receive buffer
    send_sizes, recv_sizes = fits[me], fits[:, me]
    out_offsets, recv_offsets = landing[me], landing[:, me]
    ex = functools.partial(exchange, axis_name=axis_name, impl=impl, block=plan.peer_rows, own_adjoint=own_adjoint)

    def send(rows: jax.Array, pad: float) -> jax.Array:
        return ex(rows, plan.send_offsets, send_sizes, out_offsets, recv_sizes, rows=capacity, pad=pad)

    recv_x = send(x[plan.row_token], 0)
    copies_cap = expert_copies(plan, x.shape[0], buffer_factor)
    y_recv, copies = expand_reduce(
        recv_x, send(plan.row_experts, -1), send(plan.row_weights, 0), experts, backend, fp8, copies_cap
    )
    if copies_cap is not None and copies_cap < capacity * plan.row_experts.shape[1]:
        _guard_capacity(jax.lax.pmax(copies, axis_name), copies_cap, buffer_factor, "(token, expert) copies")
    if check:
        _check_dropless(jax.lax.psum(copies, axis_name), x.shape[0] * plan.top_k * ranks, "the expert ranks together")
    back = ex(
        y_recv.astype(x.dtype),
        recv_offsets,
        recv_sizes,
        _transpose(plan.send_offsets, axis_name),
        send_sizes,
        rows=plan.row_token.shape[0],
    )
    return jax.ops.segment_sum(back.astype(jnp.float32), plan.row_token, num_segments=x.shape[0])


def _rank_routed(
    gate: Params,
    experts: Params,
    x: jax.Array,
    *,
    cfg: MoEConfig,
    ranks: int,
    dedup: bool,
    backend: Backend,
    impl: Impl,
    axis_name: str,
    buffer_factor: float,
    own_adjoint: bool = True,
) -> tuple[jax.Array, ...]:
    """`layer.routed_experts` on one rank's tokens `x` [..., D], with the experts spread over the ranks:
    (float32 output shaped like `x`, expert ids and weights [..., k])."""
    tokens = x.reshape(-1, cfg.emb_dim)
    routing = route(gate_logits(tokens, gate["kernel"]), gate["bias"], cfg.routing)
    plan = plan_dispatch(
        routing.indices, routing.weights, cfg.routing.num_experts, ranks, dedup=dedup, check=cfg.check_dropless
    )
    routed = ep_routed(
        tokens,
        plan,
        experts,
        backend=backend,
        impl=impl,
        axis_name=axis_name,
        check=cfg.check_dropless,
        buffer_factor=buffer_factor,
        fp8=cfg.fp8,
        own_adjoint=own_adjoint,
    )
    lead = x.shape[:-1]
    return routed.reshape(x.shape), routing.indices.reshape(*lead, -1), routing.weights.reshape(*lead, -1)


def _rank_forward(gate: Params, experts: Params, shared: Params, x: jax.Array, **kw) -> tuple[jax.Array, ...]:
    """`layer.moe_forward` on one rank's tokens, with the routed experts spread over the ranks."""
    routed, indices, weights = _rank_routed(gate, experts, x, **kw)
    y = routed + shared_expert(x, shared).astype(jnp.float32)
    return y.astype(x.dtype), indices, weights


def _split_tokens(x: jax.Array, cfg: MoEConfig, ranks: int) -> jax.Array:
    if x.shape[-1] != cfg.emb_dim:
        raise UserError(f"MoE input width {x.shape[-1]} != emb_dim {cfg.emb_dim}.")
    tokens = x.reshape(-1, cfg.emb_dim)
    if tokens.shape[0] % ranks:
        raise UserError(
            f"{tokens.shape[0]} tokens do not split evenly over {ranks} expert-parallel ranks.",
            fix="make batch x sequence a multiple of the expert-parallel size.",
        )
    return tokens


def _routing(indices: jax.Array, weights: jax.Array, cfg: MoEConfig) -> Routing:
    k = cfg.routing.top_k
    indices, weights = indices.reshape(-1, k), weights.reshape(-1, k)
    counts = jnp.bincount(indices.reshape(-1), length=cfg.routing.num_experts).astype(jnp.int32)
    return Routing(indices, weights, counts)


_EXPERT_KEYS = ("wi_0", "wi_1", "wo")


def ep_moe_forward_emulated(
    params: Params, x: jax.Array, cfg: MoEConfig, ranks: int, *, dedup: bool = True, backend: Backend = "ragged_dot"
) -> tuple[jax.Array, Routing]:
    """`moe_forward` computed as R expert-parallel ranks on one device: tokens split into R contiguous
    slices, experts into R shards, ranks on a leading axis through `vmap`, exchange emulated. The CPU
    reference for the dispatch bookkeeping (XLA:CPU has no ragged_all_to_all)."""
    tokens = _split_tokens(x, cfg, ranks)
    num_local = local_experts(cfg.routing.num_experts, ranks)
    p = params["MoeBlock_0"]
    shards = {n: p[n].reshape(ranks, num_local, *p[n].shape[1:]) for n in _EXPERT_KEYS}
    body = functools.partial(
        _rank_forward,
        cfg=cfg,
        ranks=ranks,
        dedup=dedup,
        backend=backend,
        impl="emulated",
        axis_name=EP_AXIS,
        buffer_factor=-1.0,
        own_adjoint=False,
    )
    y, indices, weights = jax.vmap(body, in_axes=(None, 0, None, 0), axis_name=EP_AXIS)(
        p["gate"], shards, params["shared_experts"], tokens.reshape(ranks, -1, cfg.emb_dim)
    )
    return y.reshape(x.shape), _routing(indices, weights, cfg)


def ep_routed_sharded(
    p: Params,
    x: jax.Array,
    cfg: MoEConfig,
    mesh: Mesh,
    *,
    token_spec: P,
    axis_name: str = EP_AXIS,
    dedup: bool = True,
    backend: Backend = "ragged_dot",
    impl: Impl = "ragged_all_to_all",
    buffer_factor: float = -1.0,
    check_vma: bool | None = None,
) -> tuple[jax.Array, Routing]:
    """The routed experts (`p`: MaxText's `MoeBlock_0` tree) on `x` [..., D] under `shard_map` over `mesh`:
    (float32 output shaped like `x`, the routing used).

    `token_spec` is how `x` is sharded (its last dimension unsharded); each device routes its own tokens
    and exchanges them over `axis_name` only, so other mesh axes (data, FSDP) stay independent groups, and
    a token axis that is not sharded over `axis_name` is still correct (each rank then serves its copy).
    The experts are split over `axis_name` on their first dimension and replicated over the other axes
    (GSPMD gathers any other sharding at the boundary), the gate is replicated. "ragged_all_to_all" is
    refused up front on CPU devices, where XLA would fail at compile time with an opcode error; "emulated"
    runs there (and on GPUs, as a cross-check of the real collective). `check_vma` None means on for
    `ragged_dot` only: the custom VJPs of TE 2.20's grouped GEMM and of tokamax 0.0.17's ragged_dot return
    weight gradients without shard_map's varying-axis type, which JAX then rejects (both seen on two H200s).
    """
    if impl == "ragged_all_to_all" and any(d.platform == "cpu" for d in mesh.devices.flat):
        raise UserError(
            "ragged_all_to_all is not implemented on XLA:CPU; use the emulated exchange.",
            fix="pass impl='emulated' (or ep_moe_forward_emulated) on CPU; the real collective needs GPUs.",
        )
    ranks = mesh.shape[axis_name]
    local_experts(cfg.routing.num_experts, ranks)  # our message, before shard_map's own about uneven shards
    body = functools.partial(
        _rank_routed,
        cfg=cfg,
        ranks=ranks,
        dedup=dedup,
        backend=backend,
        impl=impl,
        axis_name=axis_name,
        buffer_factor=buffer_factor,
    )
    routed, indices, weights = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(axis_name), token_spec),
        out_specs=token_spec,
        check_vma=backend == "ragged_dot" if check_vma is None else check_vma,
    )(p["gate"], {n: p[n] for n in _EXPERT_KEYS}, x)
    return routed, _routing(indices, weights, cfg)


def ep_moe_forward_sharded(
    params: Params,
    x: jax.Array,
    cfg: MoEConfig,
    mesh: Mesh,
    *,
    axis_name: str = EP_AXIS,
    dedup: bool = True,
    backend: Backend = "ragged_dot",
    impl: Impl = "ragged_all_to_all",
    buffer_factor: float = -1.0,
) -> tuple[jax.Array, Routing]:
    """`moe_forward` with tokens and experts sharded over `mesh` axis `axis_name`: `ep_routed_sharded` on the
    tokens split into contiguous slices, plus the shared expert."""
    tokens = _split_tokens(x, cfg, ranks=mesh.shape[axis_name])
    routed, routing = ep_routed_sharded(
        params["MoeBlock_0"],
        tokens,
        cfg,
        mesh,
        token_spec=P(axis_name),
        axis_name=axis_name,
        dedup=dedup,
        backend=backend,
        impl=impl,
        buffer_factor=buffer_factor,
    )
    y = routed + shared_expert(tokens, params["shared_experts"]).astype(jnp.float32)
    return y.astype(x.dtype).reshape(x.shape), routing


def dispatch_bytes_per_token(
    expert_ids: jax.Array, num_experts: int, ranks: int, hidden: int, dtype_bytes: int, dedup: bool
) -> float:
    """Activation bytes per token that cross ranks in the dispatch (the combine returns as many rows).

    Tokens `expert_ids` [T, k] are split into R contiguous slices, slice r on rank r (as the EP layer
    shards the batch); rows a rank sends to itself are not counted. Counts rows from `plan_dispatch`
    itself, so the figure is that of the rows the layer sends; routing metadata (k int32 ids and float32
    weights per row with dedup, one of each without) is left out: under 1% at hidden 7168 in BF16.
    """
    tokens = jnp.asarray(expert_ids).reshape(ranks, -1, expert_ids.shape[-1])
    plan = functools.partial(plan_dispatch, num_experts=num_experts, ranks=ranks, dedup=dedup)
    counts = np.asarray(jax.jit(jax.vmap(lambda ids: plan(ids, jnp.ones(ids.shape)).send_counts))(tokens))
    crossing = counts.sum() - np.trace(counts)
    return float(crossing) * hidden * dtype_bytes / expert_ids.shape[0]
