"""Dropless routed MoE with one shared expert, forward for one device (differentiable).

Why our own: MaxText 0.2.5's `RoutedMoE.sparse_matmul` reaches only `ragged_dot`/tokamax for the expert
GEMMs, and its TE block refuses the aux-loss-free bias update. This layer keeps MaxText's parameter tree
(`RoutedAndSharedMoE`: `MoeBlock_0/{gate/{kernel,bias}, wi_0, wi_1, wo}`, `shared_experts/{wi_0,wi_1,wo}/kernel`;
with MaxText's `prefuse_moe_weights`, one `wi` [E, D, 2F] in place of wi_0 and wi_1) and DeepSeek-V3
semantics, and takes how the experts compute (`settings.ExpertPath`: grouped-GEMM backend, FP8) as one argument.

Steps: route (float32) -> repeat each token k times and sort the copies by expert -> grouped GEMMs
wi_0, wi_1 -> SiLU(h0) * h1 * routing weight -> grouped GEMM wo -> unsort -> sum over the k copies -> + shared
expert. The routing weight scales each copy before wo rather than after it (the same product, wo being
linear): the backward pass then needs the activation, which it recomputes from the saved wi_0 and wi_1
outputs, and not the wo output, a [copies, emb_dim] buffer per layer (3.8 GB at batch 8 of the one-H200 proxy)
that the weight's gradient would otherwise keep from the forward pass.
No token is dropped: every copy lands in exactly one expert's rows (checked, see `sort_by_expert`).
Expert parallelism (dispatch across devices, with per-rank deduplication) is in `expert_parallel`, which
runs the same `expert_mlp` on each rank's rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from maxtext_moe.errors import UserError
from maxtext_moe.moe import balance, scopes
from maxtext_moe.moe.align import align_groups, compose, pad_rows, take_rows, unpad_rows
from maxtext_moe.moe.gemm import group_align, grouped_matmul
from maxtext_moe.moe.remat_names import UP_OUTPUT, WO_OUTPUT
from maxtext_moe.moe.routing import Routing, RoutingConfig, route
from maxtext_moe.moe.settings import DEFAULT_PATH, ExpertPath

Params = dict[str, Any]
# MaxText's `prefuse_moe_weights` tree: wi_0 and wi_1 stored side by side as one `wi` [E, D, 2F], wi_0 first.
FUSED_UP = "wi"


def expert_keys(experts: Params) -> tuple[str, ...]:
    """The expert weights of a `MoeBlock_0` tree, fused (`wi`, `wo`) or not (`wi_0`, `wi_1`, `wo`)."""
    return (FUSED_UP, "wo") if FUSED_UP in experts else ("wi_0", "wi_1", "wo")


def up_weights(experts: Params) -> jax.Array:
    """wi_0 and wi_1 side by side [E, D, 2F], the operand of the up-projection's one grouped GEMM.

    Why the fused tree pays: unfused, the two are concatenated in the forward and again in the backward remat,
    and XLA fuses their AdamW updates, which read one gradient, into one kernel whose wi_1 outputs it then
    copies into place; stored fused, none of the three copies is made.
    """
    if FUSED_UP in experts:
        return experts[FUSED_UP]
    return jnp.concatenate([experts["wi_0"], experts["wi_1"]], axis=-1)


def fuse_up(block: Params) -> Params:
    """A `MoeBlock_0` tree with wi_0 and wi_1 replaced by MaxText's fused `wi` (the same expert MLPs)."""
    rest = {k: v for k, v in block.items() if k not in ("wi_0", "wi_1")}
    return {**rest, FUSED_UP: up_weights(block)}


@dataclass(frozen=True)
class MoEConfig:
    """Widths of one MoE layer; names follow MaxText (`emb_dim`, `moe_mlp_dim`, `shared_experts`)."""

    emb_dim: int
    moe_mlp_dim: int
    routing: RoutingConfig
    shared_mlp_dim: int  # width of the shared expert (MaxText: shared_experts * moe_mlp_dim)
    check_dropless: bool = True  # host-side check of sum(group sizes) under jit (one small callback)


def init_params(key: jax.Array, cfg: MoEConfig, dtype: jnp.dtype = jnp.bfloat16) -> Params:
    """Random parameters in MaxText's tree; fan-in scaled normals, selection bias small and nonzero."""
    e, d, f, fs = cfg.routing.num_experts, cfg.emb_dim, cfg.moe_mlp_dim, cfg.shared_mlp_dim
    ks = jax.random.split(key, 8)

    def normal(k: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)).astype(dtype)

    return {
        "MoeBlock_0": {
            "gate": {"kernel": normal(ks[0], (d, e), d), "bias": (0.01 * jax.random.normal(ks[1], (e,))).astype(dtype)},
            "wi_0": normal(ks[2], (e, d, f), d),
            "wi_1": normal(ks[3], (e, d, f), d),
            "wo": normal(ks[4], (e, f, d), f),
        },
        "shared_experts": {
            "wi_0": {"kernel": normal(ks[5], (d, fs), d)},
            "wi_1": {"kernel": normal(ks[6], (d, fs), d)},
            "wo": {"kernel": normal(ks[7], (fs, d), fs)},
        },
    }


# The router's dot: each float32 operand split into two BF16 parts, three BF16 tensor-core products summed in float32.
GATE_ALGORITHM = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3


def gate_logits(x: jax.Array, gate_kernel: jax.Array) -> jax.Array:
    """Router logits in float32, so that near-ties are decided the same way in the layer and in the reference.

    Why `GATE_ALGORITHM` and not `Precision.HIGHEST`: on a GPU, XLA runs a float32 dot at HIGHEST on the CUDA
    cores, and the router's dots (forward, its rematerialization, and the gradients of the activations and the
    kernel) then cost more than their 7168 x 32 shape suggests. With BF16 activations and weights, as every
    recipe stores them, the split leaves nothing in the low parts: the logits' products are exact and summed in
    float32, as at HIGHEST. The gradients' float32 cotangents keep 16 bits of their 24-bit significands."""
    return jnp.dot(x.astype(jnp.float32), gate_kernel.astype(jnp.float32), precision=GATE_ALGORITHM)


def _raise_if_lost(total: np.ndarray, expected: int, where: str, scope: str) -> None:
    if int(total) != expected:
        raise UserError(
            f"{scope} dispatch is not dropless: {where} hold {int(total)} (token, expert) copies, expected "
            f"{expected} (tokens x top-k); an expert index is outside [0, num_experts), or the dispatch plan "
            "is inconsistent."
        )


def check_dropless(total: jax.Array, expected: int, where: str, scope: str = "MoE") -> None:
    """Raise unless `total` (token, expert) copies were placed, `expected` being tokens x top-k: eagerly when
    `total` is concrete, else from a host callback under jit. The one dropless check of the one-device layer
    and of the EP dispatch (`scope` says which)."""
    if isinstance(total, jax.core.Tracer):
        jax.debug.callback(functools.partial(_raise_if_lost, expected=expected, where=where, scope=scope), total)
    else:
        _raise_if_lost(np.asarray(total), expected, where, scope)


def sort_by_expert(indices: jax.Array, num_experts: int, check: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Order the T*k (token, slot) copies by expert: returns (order, inverse order, group sizes [E]).

    `order[j]` is the flat copy index placed at sorted row j. The dropless check runs eagerly when the
    indices are concrete, and as a host callback under jit when `check` is set.
    """
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    inverse = jnp.argsort(order)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    if check:
        check_dropless(jnp.sum(group_sizes), flat.shape[0], "the expert groups")
    return order, inverse, group_sizes


def shared_expert(x: jax.Array, p: Params) -> jax.Array:
    """MaxText's MlpBlock with activations (silu, linear): wo(silu(x wi_0) * (x wi_1))."""
    h0 = x @ p["wi_0"]["kernel"].astype(x.dtype)
    h1 = x @ p["wi_1"]["kernel"].astype(x.dtype)
    return (jax.nn.silu(h0) * h1) @ p["wo"]["kernel"].astype(x.dtype)


def expert_mlp(
    x_sorted: jax.Array,
    experts: Params,
    group_sizes: jax.Array,
    path: ExpertPath,
    *,
    partial: bool = False,
    groups_aligned: bool = False,
    row_weights: jax.Array | None = None,
) -> jax.Array:
    """SiLU-GLU experts on rows sorted by expert: wo(silu(wi_0 x) * wi_1 x * row_weights), one grouped GEMM each.

    wi_0 and wi_1 run as one grouped GEMM on their weights side by side. The GEMM outputs carry MaxText's remat
    names (`remat_names.py`), so one `remat_policy` saves or offloads the same tensors with either block, on one
    device or under expert parallelism; the up-projection's output is kept or recomputed whole. No backward pass
    reads wo's output (the weights come before wo); a policy that would save it keeps the FP8 operands instead
    (`upstream/remat.py`).
    `partial`: the groups may end before the last row (see `grouped_matmul`). An FP8 path pads the groups
    once for the three GEMMs, unless the caller already has (`groups_aligned`, as `expert_mlp_on_copies`).
    `row_weights` [M] (float32, None: 1) is each row's routing weight, applied before wo (see the module).
    """
    align = group_align(path.fp8)
    if align > 1 and not groups_aligned:
        a = align_groups(group_sizes, x_sorted.shape[0], align)
        weights = None if row_weights is None else pad_rows(row_weights, a)
        out = expert_mlp(pad_rows(x_sorted, a), experts, a.group_sizes, path, groups_aligned=True, row_weights=weights)
        return unpad_rows(out, a)
    gmm = functools.partial(
        grouped_matmul,
        group_sizes=group_sizes,
        backend=path.backend,
        fp8=path.fp8,
        partial=partial,
        groups_aligned=groups_aligned,
        fp8_cast=path.fp8_cast,
    )
    with jax.named_scope(scopes.EXPERTS):
        h = gmm(x_sorted, up_weights(experts))
        for name in UP_OUTPUT:
            h = checkpoint_name(h, name)
        h0, h1 = jnp.split(h, 2, axis=-1)
        act = jax.nn.silu(h0.astype(jnp.float32)) * h1.astype(jnp.float32)
        if row_weights is not None:
            act = act * row_weights.astype(jnp.float32)[:, None]
        act = act.astype(x_sorted.dtype)
        out = gmm(act, experts["wo"])
        for name in WO_OUTPUT:
            out = checkpoint_name(out, name)
        return out


class SortedCopies(NamedTuple):
    """Where each copy sits once sorted by expert, and each expert group padded where the GEMM needs it."""

    index: jax.Array  # [P]: the copy each sorted row holds; N (past the copies) for a padding row
    back: jax.Array  # [N]: each copy's sorted row; P for a copy left out
    group_sizes: jax.Array  # [E]: rows of each group, padding included
    partial: bool  # the groups may end before the last sorted row
    aligned: bool  # the groups are padded to the GEMM's row multiple


def sorted_copies(
    order: jax.Array, inverse: jax.Array, group_sizes: jax.Array, path: ExpertPath, *, partial: bool
) -> SortedCopies:
    """The sort `order` [R] / `inverse` [N] of N copies, with an FP8 path's group padding composed into the same
    maps (`align.compose`): one copy of the rows each way, where padding after sorting would copy them twice."""
    align = group_align(path.fp8)
    if align > 1:
        a = align_groups(group_sizes, order.shape[0], align)
        index, back = compose(order, inverse, a)
        return SortedCopies(index, back, a.group_sizes, partial=False, aligned=True)
    return SortedCopies(order, inverse, group_sizes, partial=partial, aligned=False)


def expert_mlp_on_copies(
    copies: jax.Array,
    order: jax.Array,
    inverse: jax.Array,
    group_sizes: jax.Array,
    experts: Params,
    path: ExpertPath,
    *,
    partial: bool,
    copy_weights: jax.Array | None = None,
) -> jax.Array:
    """The experts on `copies` [N, D] in token order: sorted by expert (`order` [R] of the N, R < N when some
    are left out; `inverse` [N], R for those), `expert_mlp`, back to token order [N, D] (zero where left out).
    `partial`: the groups may end before the R-th sorted row. `copy_weights` [N] (float32): each copy's
    routing weight, which `expert_mlp` applies before wo.
    """
    s = sorted_copies(order, inverse, group_sizes, path, partial=partial)
    fill = s.aligned or order.shape[0] < copies.shape[0]
    with jax.named_scope(scopes.PERMUTE):
        x_sorted = take_rows(copies, s.index, s.back, fill)
        weights = None if copy_weights is None else take_rows(copy_weights, s.index, s.back, fill)
    out = expert_mlp(
        x_sorted, experts, s.group_sizes, path, partial=s.partial, groups_aligned=s.aligned, row_weights=weights
    )
    with jax.named_scope(scopes.UNPERMUTE):
        return take_rows(out, s.back, s.index, fill)


def routed_experts(
    p: Params, tokens: jax.Array, cfg: MoEConfig, path: ExpertPath = DEFAULT_PATH
) -> tuple[jax.Array, Routing]:
    """The routed experts alone on `tokens` [T, emb_dim]: (float32 [T, emb_dim], the routing used, with the
    copies the grouped GEMMs did not reach as `dropped`).

    `p` is MaxText's `MoeBlock_0` subtree.
    """
    k = cfg.routing.top_k
    with jax.named_scope(scopes.ROUTING):
        routing = route(gate_logits(tokens, p["gate"]["kernel"]), p["gate"]["bias"], cfg.routing)
        order, inverse, group_sizes = sort_by_expert(routing.indices, cfg.routing.num_experts, cfg.check_dropless)
    weights = routing.weights.reshape(-1).astype(jnp.float32)
    copies = jnp.repeat(tokens, k, axis=0)
    out = expert_mlp_on_copies(copies, order, inverse, group_sizes, p, path, partial=False, copy_weights=weights)
    with jax.named_scope(scopes.UNPERMUTE):
        routed = jnp.sum(out.reshape(-1, k, cfg.emb_dim), axis=1, dtype=jnp.float32)
    return routed, routing._replace(dropped=balance.dropped(order.shape[0], jnp.sum(group_sizes)))


def moe_forward(
    params: Params, x: jax.Array, cfg: MoEConfig, path: ExpertPath = DEFAULT_PATH
) -> tuple[jax.Array, Routing]:
    """Routed + shared MoE on `x` [..., emb_dim] -> (same shape and dtype, the routing used)."""
    if x.shape[-1] != cfg.emb_dim:
        raise UserError(f"MoE input width {x.shape[-1]} != emb_dim {cfg.emb_dim}.")
    tokens = x.reshape(-1, cfg.emb_dim)
    routed, routing = routed_experts(params["MoeBlock_0"], tokens, cfg, path)
    y = routed + shared_expert(tokens, params["shared_experts"]).astype(jnp.float32)
    return y.astype(x.dtype).reshape(x.shape), routing
