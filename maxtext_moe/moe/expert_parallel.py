"""Expert parallelism (EP) with per-destination-rank deduplication: the routed experts over R ranks.

Why our own: MaxText 0.2.5's EP path (`layers/moe.py`, `sparse_matmul=true`) sends a token once per chosen
expert through `jax.lax.ragged_all_to_all`, and `ragged_all_to_all` has no XLA:CPU implementation, so
that bookkeeping cannot be tested off-GPU. Here a token goes to each destination rank once (`send_plan`);
the destination expands the row to its local experts, runs the grouped GEMMs, reduces the weighted
outputs (`receive`), and sends ONE row back; the source adds the per-rank partial sums. One step:
plan -> exchange -> expand/reduce -> exchange back -> sum (`ep_routed`), every shape static.

Drivers: `ep_moe_forward_emulated` (ranks on an explicit leading axis through `vmap`: the CPU reference),
`ep_routed_sharded` (the routed experts under `shard_map` over any mesh with an expert axis: what
`upstream/deepseek_layer.py` runs inside MaxText's decoder) and `ep_moe_forward_sharded` (it plus the
shared expert). How the experts compute (backend, FP8, exchange, buffer, dedup, axis) is one
`settings.ExpertPath`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.errors import UserError
from maxtext_moe.moe import balance, nccl_ep, scopes
from maxtext_moe.moe.backward_order import weight_grads_first
from maxtext_moe.moe.exchange import exchange, transpose
from maxtext_moe.moe.layer import MoEConfig, Params, check_dropless, expert_keys, gate_logits, shared_expert
from maxtext_moe.moe.receive import expand_reduce, expert_copies, guard_capacity, receive_rows
from maxtext_moe.moe.routing import Routing, route
from maxtext_moe.moe.send_plan import DispatchPlan, local_experts, plan_dispatch
from maxtext_moe.moe.settings import DEFAULT_PATH, EP_AXIS, GPU_EXCHANGES, ExpertPath

__all__ = ["EP_AXIS", "ep_moe_forward_emulated", "ep_moe_forward_sharded", "ep_routed", "ep_routed_sharded"]


def ep_routed(
    x: jax.Array, plan: DispatchPlan, experts: Params, path: ExpertPath, *, check: bool = True
) -> tuple[jax.Array, jax.Array]:
    """Routed-expert output [T, D] float32 for this rank's tokens `x` [T, D], its `plan`, and its expert
    shard `experts` ({wi_0, wi_1: [L, D, F], wo: [L, F, D]}, or one wi [L, D, 2F] for wi_0 and wi_1), and the
    (token, expert) copies the ranks' experts computed together (int32, the same on every rank). Runs per rank
    under shard_map or vmap over `path.axis_name`.

    Send: row i of the send buffer is x[row_token[i]]; in each destination's receive buffer (`receive_rows`
    rows, pre-filled as padding: zeros, expert -1) the senders' rows follow one another in rank order.
    Return: each destination sends one reduced row per received row back to the position it came from; the
    source sums rows per token. With a capped buffer (`path.buffer_factor` > 0) rows past the end are never
    sent, the grouped GEMMs run `expert_copies` copies, and `guard_capacity` stops the step when either
    bound is short; the `check` of copies still counts every (token, expert) pair.
    """
    axis, factor = path.axis_name, path.buffer_factor
    ranks = plan.send_counts.shape[0]
    capacity = receive_rows(plan, factor)
    me = jax.lax.axis_index(axis)
    counts = jax.lax.all_gather(plan.send_counts, axis)  # [source, destination]
    landing = jnp.cumsum(counts, axis=0) - counts  # where source s's rows start in destination d's buffer
    if capacity < ranks * plan.peer_rows:
        guard_capacity(jnp.max(jnp.sum(counts, axis=0)), capacity, factor, "rows")
    fits = jnp.clip(capacity - landing, 0, counts)  # never write past a receive buffer
    send_sizes, recv_sizes = fits[me], fits[:, me]
    out_offsets, recv_offsets = landing[me], landing[:, me]
    ex = functools.partial(
        exchange, axis_name=axis, impl=path.exchange, block=plan.peer_rows, own_adjoint=path.own_adjoint
    )

    def send(rows: jax.Array, pad: float) -> jax.Array:
        with jax.named_scope(scopes.EXCHANGE):
            return ex(rows, plan.send_offsets, send_sizes, out_offsets, recv_sizes, rows=capacity, pad=pad)

    recv_x = send(x[plan.row_token], 0)
    copies_cap = expert_copies(plan, x.shape[0], factor)
    with jax.named_scope(scopes.PERMUTE):  # expert_mlp inside names its own scope
        y_recv, copies = expand_reduce(
            recv_x, send(plan.row_experts, -1), send(plan.row_weights, 0), experts, path, copies_cap
        )
    if copies_cap is not None and copies_cap < capacity * plan.row_experts.shape[1]:
        guard_capacity(jax.lax.pmax(copies, axis), copies_cap, factor, "(token, expert) copies")
    computed = jax.lax.psum(copies, axis)
    if check:
        expected = x.shape[0] * plan.top_k * ranks
        check_dropless(computed, expected, "the expert ranks together", scope="EP")
    with jax.named_scope(scopes.EXCHANGE):
        back = ex(
            y_recv.astype(x.dtype),
            recv_offsets,
            recv_sizes,
            transpose(plan.send_offsets, axis),
            send_sizes,
            rows=plan.row_token.shape[0],
        )
    with jax.named_scope(scopes.UNPERMUTE):
        routed = jax.ops.segment_sum(back.astype(jnp.float32), plan.row_token, num_segments=x.shape[0])
    return routed, computed


def _rank_routed(
    gate: Params,
    experts: Params,
    x: jax.Array,
    *,
    cfg: MoEConfig,
    ranks: int,
    path: ExpertPath,
    gather: dict[str, Gathers] | None = None,
) -> tuple[jax.Array, ...]:
    """`layer.routed_experts` on one rank's tokens `x` [..., D], with the experts spread over the ranks:
    (float32 output shaped like `x`, expert ids and weights [..., k], the (token, expert) copies the ranks
    did not compute [1], the same on every rank of the group). `gather`: per weight, the mesh axes each of
    its dimensions is gathered over first (`expert_gathers`)."""
    for name, dims in (gather or {}).items():
        for dim, axes in enumerate(dims):
            if axes:
                experts = {**experts, name: jax.lax.all_gather(experts[name], axes, axis=dim, tiled=True)}
    tokens, experts = weight_grads_first(x.reshape(-1, cfg.emb_dim), experts)
    with jax.named_scope(scopes.ROUTING):
        routing = route(gate_logits(tokens, gate["kernel"]), gate["bias"], cfg.routing)
    chunks = path.dispatch_chunks
    if tokens.shape[0] % chunks:
        raise UserError(
            f"{tokens.shape[0]} tokens per expert-parallel rank do not split into {chunks} dispatch chunks.",
            fix="set moe.dispatch_chunks to a divisor of the tokens per rank (batch x sequence / EP), or 1.",
        )
    # Each chunk is routed as one, planned, exchanged and computed by itself: nothing orders one chunk's
    # all-to-alls after another's GEMMs, so XLA's scheduler may overlap them.
    routed, computed = [], 0
    split = (jnp.split(a, chunks) for a in (tokens, routing.indices, routing.weights))
    for part, indices, weights in zip(*split, strict=True):
        with jax.named_scope(scopes.ROUTING):
            plan = plan_dispatch(
                indices, weights, cfg.routing.num_experts, ranks, dedup=path.dedup, check=cfg.check_dropless
            )
        out, copies = ep_routed(part, plan, experts, path, check=cfg.check_dropless)
        routed.append(out)
        computed += copies
    routed = jnp.concatenate(routed) if chunks > 1 else routed[0]
    lost = balance.dropped(tokens.shape[0] * cfg.routing.top_k * ranks, computed)
    lead = x.shape[:-1]
    return (
        routed.reshape(x.shape),
        routing.indices.reshape(*lead, -1),
        routing.weights.reshape(*lead, -1),
        lost.reshape(1),
    )


def _rank_forward(gate: Params, experts: Params, shared: Params, x: jax.Array, **kw) -> tuple[jax.Array, ...]:
    """`layer.moe_forward` on one rank's tokens, with the routed experts spread over the ranks."""
    routed, indices, weights, lost = _rank_routed(gate, experts, x, **kw)
    y = routed + shared_expert(x, shared).astype(jnp.float32)
    return y.astype(x.dtype), indices, weights, lost


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


def _routing(indices: jax.Array, weights: jax.Array, lost: jax.Array, ranks: int, cfg: MoEConfig) -> Routing:
    """The routing of all ranks; `lost` holds each rank's count of its group's lost copies, so the sum over
    ranks / `ranks` is the sum over expert-parallel groups."""
    k = cfg.routing.top_k
    indices, weights = indices.reshape(-1, k), weights.reshape(-1, k)
    counts = jnp.bincount(indices.reshape(-1), length=cfg.routing.num_experts).astype(jnp.int32)
    return Routing(indices, weights, counts, jnp.sum(lost) / ranks)


Gathers = tuple[tuple[str, ...], ...]  # per dimension of a weight: the mesh axes it is gathered over


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def expert_gathers(spec: P, ndim: int, axis: str) -> Gathers | None:
    """How a rank rebuilds its whole expert shard from an expert weight sharded as `spec`: per dimension, the
    mesh axes to gather over (every axis but the expert axis). None when the layout does not allow it (the
    expert axis is not the leading axis of the first dimension, or shards another dimension): the caller
    then lets GSPMD gather at the shard_map boundary.

    Why: a weight that enters the shard_map replicated over FSDP is gathered by GSPMD at the boundary, and
    its gradient leaves it as an all-reduce of the whole shard over FSDP: at DeepSeek-V3 scale 0.94 GB per
    weight, each kept until its collective runs. Gathered inside (`jax.lax.all_gather`), the gradient
    leaves as the transpose, a reduce-scatter, FSDP's own pattern, and full remat re-gathers in the backward.
    """
    dims = [_axes(e) for e in spec] + [()] * (ndim - len(spec))
    if not dims[0] or dims[0][0] != axis or any(axis in d for d in [dims[0][1:], *dims[1:]]):
        return None
    return tuple(tuple(a for a in d if a != axis) for d in dims)


# The sharded drivers' exchange unless told otherwise: the real collective.
_SHARDED = ExpertPath(exchange="ragged_all_to_all")


def ep_moe_forward_emulated(
    params: Params, x: jax.Array, cfg: MoEConfig, ranks: int, path: ExpertPath = DEFAULT_PATH
) -> tuple[jax.Array, Routing]:
    """`moe_forward` computed as R expert-parallel ranks on one device: tokens split into R contiguous
    slices, experts into R shards, ranks on a leading axis through `vmap`, exchange emulated. The CPU
    reference for the dispatch bookkeeping (XLA:CPU has no ragged_all_to_all). Of `path` it takes the
    backend, FP8 and dedup; the buffer is the dropless worst case."""
    tokens = _split_tokens(x, cfg, ranks)
    num_local = local_experts(cfg.routing.num_experts, ranks)
    p = params["MoeBlock_0"]
    shards = {n: p[n].reshape(ranks, num_local, *p[n].shape[1:]) for n in expert_keys(p)}
    path = dataclasses.replace(path, exchange="emulated", axis_name=EP_AXIS, buffer_factor=-1.0, own_adjoint=False)
    body = functools.partial(_rank_forward, cfg=cfg, ranks=ranks, path=path)
    y, indices, weights, lost = jax.vmap(body, in_axes=(None, 0, None, 0), axis_name=EP_AXIS)(
        p["gate"], shards, params["shared_experts"], tokens.reshape(ranks, -1, cfg.emb_dim)
    )
    return y.reshape(x.shape), _routing(indices, weights, lost, ranks, cfg)


def ep_routed_sharded(
    p: Params,
    x: jax.Array,
    cfg: MoEConfig,
    mesh: Mesh,
    *,
    token_spec: P,
    path: ExpertPath = _SHARDED,
    check_vma: bool | None = None,
    expert_specs: dict[str, P] | None = None,
) -> tuple[jax.Array, Routing]:
    """The routed experts (`p`: MaxText's `MoeBlock_0` tree) on `x` [..., D] under `shard_map` over `mesh`:
    (float32 output shaped like `x`, the routing used).

    `token_spec` is how `x` is sharded (its last dimension unsharded); each device routes its own tokens
    and exchanges them over `path.axis_name` only, so other mesh axes (data, FSDP) stay independent groups,
    and a token axis that is not sharded over it is still correct (each rank then serves its copy).
    The experts are split over that axis on their first dimension; `expert_specs` (each weight's own
    sharding, e.g. also over FSDP) lets them enter as they are stored and be gathered inside
    (`expert_gathers`); without it they enter replicated over the other axes (GSPMD gathers at the
    boundary). The gate is replicated. "ragged_all_to_all" and
    "nccl_ep" are refused up front on CPU devices, where XLA would fail at compile time with an opcode error;
    "emulated" runs there (and on GPUs, as a cross-check of the real collective). "nccl_ep" hands the whole
    step to `nccl_ep.routed` (TE's NCCL EP dispatch and combine, which reshard the tokens themselves).
    `check_vma` None means on for `ragged_dot` only: the custom VJPs of TE 2.20's grouped GEMM and of
    tokamax 0.0.17's ragged_dot return weight gradients without shard_map's varying-axis type, which JAX then rejects.
    """
    if path.exchange in GPU_EXCHANGES and any(d.platform == "cpu" for d in mesh.devices.flat):
        raise UserError(
            f"{path.exchange} does not run on CPU devices (XLA:CPU has no ragged all-to-all, NCCL EP is NCCL's).",
            fix="pass exchange='all_to_all' or 'emulated' (or ep_moe_forward_emulated) on CPU; it needs GPUs.",
        )
    if path.exchange == "nccl_ep":
        return nccl_ep.routed(p, x, cfg, mesh, path=path, check_vma=check_vma)
    axis = path.axis_name
    ranks = mesh.shape[axis]
    local_experts(cfg.routing.num_experts, ranks)  # our message, before shard_map's own about uneven shards
    gather = {n: expert_gathers(s, p[n].ndim, axis) for n, s in (expert_specs or {}).items()}
    if None in gather.values():
        gather = {}
    specs = {n: expert_specs[n] if gather else P(axis) for n in expert_keys(p)}
    routed, indices, weights, lost = jax.shard_map(
        functools.partial(_rank_routed, cfg=cfg, ranks=ranks, path=path, gather=gather),
        mesh=mesh,
        in_specs=(P(), specs, token_spec),
        out_specs=(token_spec, token_spec, token_spec, P(mesh.axis_names)),  # lost: one entry per device
        check_vma=path.backend == "ragged_dot" if check_vma is None else check_vma,
    )(p["gate"], {n: p[n] for n in expert_keys(p)}, x)
    return routed, _routing(indices, weights, lost, ranks, cfg)


def ep_moe_forward_sharded(
    params: Params, x: jax.Array, cfg: MoEConfig, mesh: Mesh, path: ExpertPath = _SHARDED
) -> tuple[jax.Array, Routing]:
    """`moe_forward` with tokens and experts sharded over `mesh` axis `path.axis_name`: `ep_routed_sharded`
    on the tokens split into contiguous slices, plus the shared expert."""
    tokens = _split_tokens(x, cfg, ranks=mesh.shape[path.axis_name])
    routed, routing = ep_routed_sharded(
        params["MoeBlock_0"], tokens, cfg, mesh, token_spec=P(path.axis_name), path=path
    )
    y = routed + shared_expert(tokens, params["shared_experts"]).astype(jnp.float32)
    return y.astype(x.dtype).reshape(x.shape), routing
