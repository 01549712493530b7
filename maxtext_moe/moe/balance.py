"""Load-balance statistics of one MoE layer: tokens per expert, the busiest expert's share, dropped copies and
the router's selection bias.

Why our own: MaxText 0.2.5 reports routing balance only as `moe_max_load_ratio` (one number over all layers,
and its config refuses it outside the ring-of-experts path) and as a checksum of all routed biases; neither
says which layer is out of balance, nor whether a dropless layer dropped anything. These are pure functions
of what a layer already holds (its expert counts [E], the copies its experts computed, its bias [E]): a few
reductions over E values, cheap enough to run every step. The layers sow them and the training step turns
them into per-layer scalars (`upstream/balance_metrics.py`).

Names (the per-layer scalars are `moe/<name>/<layer>`):
  tokens_max     tokens routed to the busiest expert
  tokens_mean    tokens per expert on average (tokens x top-k / experts)
  top_share      the busiest expert's share of all (token, expert) copies (1/E when balanced)
  dropped        (token, expert) copies the experts did not compute (0 in a dropless layer)
  bias_min, bias_max, bias_mean_abs   the aux-loss-free selection bias the layer routed with
  seq_balance_loss   the layer's sequence-wise balance loss, weighted (`sequence_balance_loss`; only when on)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOAD_STATS = ("tokens_max", "tokens_mean", "top_share")
DROPPED = "dropped"
BIAS_STATS = ("bias_min", "bias_max", "bias_mean_abs")
SEQ_BALANCE_LOSS = "seq_balance_loss"


def load_stats(counts: jax.Array) -> dict[str, jax.Array]:
    """Tokens per expert from `counts` [E] (one layer's (token, expert) copies per expert), float32 scalars."""
    load = counts.astype(jnp.float32)
    busiest = jnp.max(load)
    return {
        "tokens_max": busiest,
        "tokens_mean": jnp.mean(load),
        "top_share": busiest / jnp.maximum(jnp.sum(load), 1.0),
    }


def dropped(expected: int, computed: jax.Array) -> jax.Array:
    """(token, expert) copies lost: `expected` (tokens x top-k) less the copies the grouped GEMMs ran on."""
    return (expected - computed).astype(jnp.float32)


def bias_stats(bias: jax.Array) -> dict[str, jax.Array]:
    """Min, max and mean magnitude of a selection bias [E], float32 scalars."""
    b = bias.astype(jnp.float32)
    return {"bias_min": jnp.min(b), "bias_max": jnp.max(b), "bias_mean_abs": jnp.mean(jnp.abs(b))}


def sequence_balance_loss(scores: jax.Array, top_k: int, weight: float) -> jax.Array:
    """DeepSeek-V3's complementary sequence-wise balance loss (paper section 2.1.2, eqs. 17-20) of one layer:
    `weight` (the paper's alpha) times the loss of each sequence, averaged over the batch's sequences; a
    float32 scalar, differentiable in `scores`.

    scores   [B, S, E] the router's sigmoid affinities s_{i,t}, without the selection bias

    Per sequence of S tokens: f_i = E / (K S) * (tokens whose top-K affinities hold expert i), not
    differentiated; P_i = mean over t of s_{i,t} / sum_j s_{j,t}; loss = sum_i f_i P_i (1 when the top-K sets or
    the affinities are spread evenly over the experts). The top-K is eq. 18's: of the affinities alone, over
    all experts. The experts a token is sent to differ (the selection adds the bias and the group limit); the
    paper counts the former, and so does this. Why our own: MaxText's `megatron_seq_aux_loss` lives on
    MaxText's router, which our layer replaces.

    Written on whole [B, S, ...] arrays, so the sums over a sequence are over the global sequence axis
    whatever the sharding: batch-sharded, sequence-sharded or on one device, the value is the same.
    """
    num_experts, seq = scores.shape[-1], scores.shape[1]
    s = scores.astype(jnp.float32)
    probs = jnp.mean(s / jnp.sum(s, axis=-1, keepdims=True), axis=1)  # P, [B, E]
    indices = jax.lax.top_k(jax.lax.stop_gradient(s), top_k)[1]  # [B, S, K]
    copies = jax.vmap(lambda idx: jnp.bincount(idx.reshape(-1), length=num_experts))(indices)  # [B, E]
    fraction = copies.astype(jnp.float32) * (num_experts / (top_k * seq))  # f, [B, E]
    return weight * jnp.mean(jnp.sum(fraction * probs, axis=-1))
