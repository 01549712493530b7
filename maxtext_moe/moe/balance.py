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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOAD_STATS = ("tokens_max", "tokens_mean", "top_share")
DROPPED = "dropped"
BIAS_STATS = ("bias_min", "bias_max", "bias_mean_abs")


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
