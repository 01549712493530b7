"""The routed experts over TE's NCCL EP (`moe.exchange: nccl_ep`): our routing and grouped GEMMs, NCCL's
dispatch and combine.

The gap: Transformer Engine 2.20.2 reaches NCCL EP (fused, per-rank deduplicating dispatch and combine, the
path of NVIDIA's published JAX recipe) only through its fused `moe()`, which refuses DeepSeek-V3's
aux-loss-free bias update. Its EP primitives are public (`transformer_engine.jax.ep`): this module calls
them around our own routing (group-limited top-k, bias for selection only) and our grouped GEMMs.

One step, at the global view as TE's `moe()` runs it (the EP primitives partition themselves; only the
expert GEMMs run per rank, under `shard_map`):
  route -> `ep_dispatch` (tokens [T, D] BF16, expert ids and weights [T, k]) -> per rank: the received rows
  [C, D], grouped by local expert in blocks of 128 rows (NCCL EP's alignment), `token_counts` [L] rows per
  local expert, one routing weight per row -> grouped GEMMs on those groups (as TE's `moe()` takes
  `token_counts` for its group sizes) -> times the row's weight, rows past the groups zeroed (what
  `ep_combine` asks of its caller) -> `ep_combine` (unweighted sum back to each token's rank) -> [T, D].
Gradients are TE's (`ep_dispatch`/`ep_combine` are custom VJPs; the weights' gradient flows through the
product with the received weights, as `ep_combine` says).

Bootstrap: NCCL EP needs one `ep_bootstrap` per process, before any layer is traced, with the largest
tokens per rank and the receive capacity C, inside the mesh and TE's `global_shard_guard` whose
`MeshResource.ep_resource` is the expert axis. `bootstrap` does it once per process; in training
`upstream/nccl_ep_bootstrap.py` calls it from MaxText's start-up, where MaxText bootstraps its own TE block.
C follows `ragged_buffer_factor` as MaxText's TE block sizes it (TE's `get_moe_recv_capacity_per_rank`: -1
the dropless worst case, f >= 1 that many times the balanced load). Below the worst case NCCL EP would drop
what does not fit (without `drop_on_overflow` it traps the GPU instead), so it is bootstrapped to drop and
`receive.guard_capacity` stops any step whose count (`total_recv_tokens`, taken before the drop) exceeds C:
nothing is dropped silently. Limits (TE's): at least 2 ranks (no NCCL EP on one GPU), one GPU per process
here, BF16 tokens, and at most one data-parallel axis (MaxText's `data` or `fsdp`) outside the expert axis.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.errors import UserError
from maxtext_moe.moe.layer import MoEConfig, Params, expert_keys, expert_mlp, gate_logits
from maxtext_moe.moe.receive import guard_capacity
from maxtext_moe.moe.routing import Routing, route
from maxtext_moe.moe.settings import EP_AXIS, ExpertPath

# Rows per local-expert block in NCCL EP's receive buffer (TE's `moe._ALIGN_SIZE`: NCCL EP's HT mode needs
# at least 128, and every TE grouped-GEMM recipe takes it).
ALIGN = 128
TE_FIX = "install transformer-engine[jax]==2.20.2 (pip install '.[gpu]') with NCCL >= 2.30.4, or use moe.exchange: auto"


@dataclass(frozen=True)
class Bootstrap:
    """What this process bootstrapped NCCL EP with; every layer reads its receive capacity from here."""

    ep_size: int
    num_experts: int
    top_k: int
    max_tokens_per_rank: int
    hidden_dim: int
    recv_capacity: int  # rows of each rank's receive buffer (C)
    worst_case: int  # C that no routing can exceed
    buffer_factor: float  # ragged_buffer_factor it came from (<= 0: the worst case)


_bootstrapped: Bootstrap | None = None


def _te_ep():
    try:
        from transformer_engine.jax import ep, moe, sharding
    except ImportError as e:
        raise UserError(f"moe.exchange nccl_ep needs Transformer Engine's JAX EP ({e}).", fix=TE_FIX) from None
    return ep, moe, sharding


def _leading(mesh: Mesh) -> str | tuple[str, str]:
    """How the tokens' leading dimension is split for NCCL EP: over the expert axis, within at most one
    data-parallel axis (TE's MeshResource dp or fsdp) of size > 1 outside it."""
    _, _, sharding = _te_ep()
    resource = sharding.global_mesh_resource()
    if resource.ep_resource != EP_AXIS:
        raise UserError(
            f"NCCL EP needs TE's MeshResource.ep_resource = {EP_AXIS!r}, got {resource.ep_resource!r}.",
            fix="run inside transformer_engine.jax.sharding.global_shard_guard(MeshResource(ep_resource='expert')) "
            "(MaxText's GPU training does so).",
        )
    outer = [a for a in (resource.dp_resource, resource.fsdp_resource) if a and mesh.shape.get(a, 1) > 1]
    if len(outer) > 1:
        raise UserError(
            f"NCCL EP (TE 2.20.2) takes one data-parallel axis outside the expert axis; {' and '.join(outer)} "
            "both split the mesh.",
            key="moe.exchange",
            fix="keep one of ici_data_parallelism / ici_fsdp_parallelism above 1, or use moe.exchange: auto.",
        )
    return (outer[0], EP_AXIS) if outer else EP_AXIS


def groups(mesh: Mesh) -> int:
    """Ranks the tokens are split over for NCCL EP (expert axis times its data-parallel axis, if any)."""
    lead = _leading(mesh)
    return mesh.shape[EP_AXIS] * (mesh.shape[lead[0]] if isinstance(lead, tuple) else 1)


def bootstrap(
    mesh: Mesh, *, num_experts: int, top_k: int, max_tokens_per_rank: int, hidden_dim: int, buffer_factor: float
) -> Bootstrap:
    """Start NCCL EP in this process for layers of `num_experts` experts, top-`top_k`, width `hidden_dim`, at
    most `max_tokens_per_rank` tokens per rank. Once per process: the same request again returns the first,
    another one is refused (TE keeps one communicator). Run it after `jax.distributed` and inside TE's
    `global_shard_guard` (see the module docstring)."""
    global _bootstrapped
    ep, moe, _ = _te_ep()
    ranks = mesh.shape.get(EP_AXIS, 1)
    if ranks < 2:
        raise UserError(
            f"NCCL EP needs expert parallelism of at least 2 ranks (TE's ep_bootstrap), this mesh has {ranks}.",
            key="moe.exchange",
            fix="set ici_expert_parallelism to 2 or more, or moe.exchange: auto (the only choice on one GPU).",
        )
    if 0 < buffer_factor < 1:
        raise UserError(
            f"is {buffer_factor}; NCCL EP's receive buffer takes a factor of at least 1 (TE's capacity rule).",
            key="ragged_buffer_factor",
            fix="set ragged_buffer_factor to 1 or more, or -1 for the dropless worst case.",
        )
    if jax.local_device_count() != 1:
        raise UserError(
            f"NCCL EP runs with one GPU per process here; this process drives {jax.local_device_count()}.",
            fix="launch one process per GPU (maxtext-moe launch does; JAX_LOCAL_DEVICE_IDS by hand).",
        )
    sizes = dict(num_experts=num_experts, num_experts_per_tok=top_k, max_tokens_per_rank=max_tokens_per_rank)
    worst = moe.get_moe_recv_capacity_per_rank(**sizes, ep_size=ranks)
    factor = buffer_factor if buffer_factor > 0 else None
    capacity = moe.get_moe_recv_capacity_per_rank(**sizes, ep_size=ranks, recv_capacity_factor=factor)
    wanted = Bootstrap(ranks, num_experts, top_k, max_tokens_per_rank, hidden_dim, capacity, worst, buffer_factor)
    if _bootstrapped is not None:
        if _bootstrapped != wanted:
            raise UserError(
                f"NCCL EP is already bootstrapped in this process as {_bootstrapped}; this needs {wanted}.",
                fix="run one model shape per process with moe.exchange: nccl_ep.",
            )
        return _bootstrapped
    with jax.set_mesh(mesh), mesh:
        _leading(mesh)  # our message for a layout TE cannot take, before its own
        ep.ep_bootstrap(
            world_size=None,
            rank=None,
            num_experts=num_experts,
            max_tokens_per_rank=max_tokens_per_rank,
            recv_capacity_per_rank=capacity,
            hidden_dim=hidden_dim,
            max_token_dtype=jnp.bfloat16,
            drop_on_overflow=capacity < worst,  # guarded: see the module docstring
        )
    _bootstrapped = wanted
    return wanted


def bootstrapped() -> Bootstrap:
    """This process's bootstrap; a `UserError` when there is none yet."""
    if _bootstrapped is None:
        raise UserError(
            "moe.exchange nccl_ep: NCCL EP is not bootstrapped in this process.",
            fix="call maxtext_moe.moe.nccl_ep.bootstrap after jax.distributed and before the first step "
            "(maxtext-moe train does so).",
        )
    return _bootstrapped


def _expert_rows(
    recv_x: jax.Array, recv_w: jax.Array, counts: jax.Array, experts: Params, path: ExpertPath
) -> jax.Array:
    """One rank's receive buffer [1, C, D] through its experts: weighted outputs [1, C, D] in the tokens'
    dtype, zero past the last group. Within a group, NCCL EP's padding rows are zero, and so are their
    outputs (SiLU-GLU of zero)."""
    rows, sizes = recv_x[0], counts[0].astype(jnp.int32)
    y = expert_mlp(rows, experts, sizes, path, partial=True).astype(jnp.float32)
    used = jnp.arange(rows.shape[0]) < jnp.sum(sizes)
    return jnp.where(used[:, None], y * recv_w[0][:, None], 0).astype(rows.dtype)[None]


def routed(
    p: Params, x: jax.Array, cfg: MoEConfig, mesh: Mesh, *, path: ExpertPath, check_vma: bool | None = None
) -> tuple[jax.Array, Routing]:
    """The routed experts (`p`: MaxText's `MoeBlock_0` tree) on `x` [..., D] through NCCL EP: (float32 output
    shaped like `x`, the routing used). The tokens are resharded to NCCL EP's layout (`_leading`); the
    experts are split over the expert axis on their first dimension. `check_vma` as `ep_routed_sharded`."""
    boot = bootstrapped()
    ep, _, _ = _te_ep()
    if x.dtype != jnp.bfloat16:
        raise UserError(
            f"NCCL EP dispatches BF16 tokens only (TE 2.20.2), got {x.dtype}.",
            key="dtype",
            fix="set dtype: bfloat16, or moe.exchange: auto.",
        )
    lead = _leading(mesh)

    def pin(a: jax.Array) -> jax.Array:
        """`a` split on its leading dimension as NCCL EP takes it, the rest whole (as TE's `moe()` pins)."""
        return jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(lead, *[None] * (a.ndim - 1))))

    tokens = pin(x.reshape(-1, cfg.emb_dim))
    per_rank = tokens.shape[0] // groups(mesh)
    shape = (cfg.routing.num_experts, cfg.routing.top_k, cfg.emb_dim)
    if per_rank > boot.max_tokens_per_rank or shape != (boot.num_experts, boot.top_k, boot.hidden_dim):
        raise UserError(
            f"this layer has {per_rank} tokens per rank and (experts, top-k, width) {shape}; NCCL EP was "
            f"bootstrapped for {boot.max_tokens_per_rank} and {(boot.num_experts, boot.top_k, boot.hidden_dim)}.",
            fix="bootstrap with the largest batch the process runs (maxtext-moe train does so).",
        )
    routing = route(gate_logits(tokens, p["gate"]["kernel"]), p["gate"]["bias"], cfg.routing)
    layer = ep.EpLayerConfig(top_k=cfg.routing.top_k, dispatch_output_per_expert_alignment=ALIGN)
    recv_x, recv_w, handle, counts, total = ep.ep_dispatch(
        layer,
        pin(routing.indices.astype(jnp.int32)),
        tokens,
        pin(routing.weights.astype(jnp.float32)),
        boot.recv_capacity,
    )
    if boot.recv_capacity < boot.worst_case:
        guard_capacity(jnp.max(total), boot.recv_capacity, boot.buffer_factor, "received rows (128 per expert block)")
    rows, per_row = P(lead, None, None), P(lead, None)
    weighted = jax.shard_map(
        functools.partial(_expert_rows, path=path),
        mesh=mesh,
        in_specs=(rows, per_row, per_row, P(EP_AXIS)),
        out_specs=rows,
        check_vma=path.backend == "ragged_dot" if check_vma is None else check_vma,
    )(pin(recv_x), pin(recv_w), pin(counts), {n: p[n] for n in expert_keys(p)})
    out = ep.ep_combine(layer, handle, counts, pin(weighted), tokens.shape[0])
    counts_all = jnp.bincount(routing.indices.reshape(-1), length=cfg.routing.num_experts).astype(jnp.int32)
    dropped = jnp.zeros((), jnp.float32)  # a step that would drop is stopped by the guard above
    return out.astype(jnp.float32).reshape(x.shape), Routing(routing.indices, routing.weights, counts_all, dropped)
