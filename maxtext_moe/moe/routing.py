"""DeepSeek-V3 routing and the aux-loss-free bias update, in plain JAX.

Why our own: MaxText 0.2.5 has these semantics spread over `RoutedMoE.get_topk`, `deepseek_routing` and
the gate module, tied to its config object; TE's fused router refuses the bias update. Here they are pure
functions of arrays, testable against NumPy, that both our layer and the benchmark share.

Semantics (DeepSeek-V3 paper, section 2.1.2, and its reference `inference/model.py`):
  scores  = sigmoid(logits)                       (float32)
  choice  = scores + bias                         (bias steers selection only, never the weights)
  groups  : rank each group by the sum of its top-2 `choice` values, keep the best `topk_groups`
  indices = top-k of `choice` over the experts of the kept groups
  weights = scores[indices] / sum(scores[indices]) * routed_scaling_factor
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxtext_moe.errors import UserError


@dataclass(frozen=True)
class RoutingConfig:
    """Router shape. `n_groups=1` means no group limit (MaxText's `n_routing_groups=-1`)."""

    num_experts: int
    top_k: int
    n_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 2.5

    def __post_init__(self) -> None:
        if self.num_experts % self.n_groups:
            raise UserError(
                f"num_experts={self.num_experts} is not divisible by n_groups={self.n_groups}.",
                fix="choose n_groups that divides the number of experts.",
            )
        per_group = self.num_experts // self.n_groups
        if self.n_groups > 1 and per_group < 2:
            raise UserError(
                f"group-limited routing ranks groups by their top-2 scores, but each group has {per_group} expert(s).",
                fix="use fewer groups (n_groups <= num_experts / 2).",
            )
        if not 1 <= self.topk_groups <= self.n_groups:
            raise UserError(f"topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}].")
        if self.top_k > self.topk_groups * per_group:
            raise UserError(
                f"top_k={self.top_k} exceeds the {self.topk_groups * per_group} experts in the kept groups.",
                fix="raise topk_groups or lower top_k.",
            )


class Routing(NamedTuple):
    """Per-token choice: `indices`/`weights` are [tokens, k]; `counts` is tokens per expert, [E]. `dropped`:
    the (token, expert) copies the experts did not compute, float32, measured by the layer that ran them
    (None straight from `route`, which computes no expert)."""

    indices: jax.Array
    weights: jax.Array
    counts: jax.Array
    dropped: jax.Array | None = None


def route(logits: jax.Array, bias: jax.Array, cfg: RoutingConfig) -> Routing:
    """Route tokens from float32 gate logits [T, E] and the selection bias [E].

    The bias receives no gradient (it is updated outside the optimizer by `update_bias`); the weights are
    differentiable in the logits through the unbiased scores.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = jax.lax.stop_gradient(scores + bias.astype(jnp.float32))
    if cfg.n_groups > 1:
        grouped = choice.reshape(*choice.shape[:-1], cfg.n_groups, -1)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, keep = jax.lax.top_k(group_score, cfg.topk_groups)
        group_mask = jnp.sum(jax.nn.one_hot(keep, cfg.n_groups, dtype=jnp.bool_), axis=-2, dtype=jnp.bool_)
        expert_mask = jnp.repeat(group_mask, cfg.num_experts // cfg.n_groups, axis=-1)
        choice = jnp.where(expert_mask, choice, -jnp.inf)
    _, indices = jax.lax.top_k(choice, cfg.top_k)
    chosen = jnp.take_along_axis(scores, indices, axis=-1)
    weights = chosen / jnp.sum(chosen, axis=-1, keepdims=True) * cfg.routed_scaling_factor
    counts = jnp.bincount(indices.reshape(-1), length=cfg.num_experts).astype(jnp.int32)
    return Routing(indices.astype(jnp.int32), weights, counts)


def update_bias(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3 eq. 16 ff.): b_i += rate * sign(mean load - load_i).

    Applied after each step from the tokens-per-expert `counts` of that step (summed over devices and
    micro-batches by the caller), outside the optimizer: under-loaded experts gain bias, over-loaded lose it.
    """
    load = counts.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load) - load).astype(bias.dtype)
