"""Bytes per token that cross ranks in the EP dispatch, with and without per-rank dedup (counted, not timed).

DeepSeek-V3 shapes: top-8, hidden 7168, BF16 rows; 256 routed experts at EP 8 (32 local experts) and EP 2
(128 local), and 128 experts at EP 2 (64 local, as in a two-GPU proxy). Three routings: uniform random
distinct experts; `routing.route` with random normal gate logits and zero bias, without a group limit; and
with DeepSeek-V3's 8 groups / top-4 groups, where each group lies on one rank at EP8 (four on each at
EP2), so a token reaches at most 4 (2) ranks.
Tokens are split evenly over the ranks; rows a rank keeps for itself are not counted (see
`send_plan.dispatch_bytes_per_token`). The combine sends back as many rows as the dispatch, so the round
trip is twice these figures and the factor is the same. Prints a Markdown table.

    python benchmarks/dispatch_bytes.py --tokens 16384 --seed 0
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp

from maxtext_moe.moe.routing import RoutingConfig, route
from maxtext_moe.moe.send_plan import dispatch_bytes_per_token

TOP_K, HIDDEN, BF16_BYTES = 8, 7168, 2
SETUPS = ((256, 8), (256, 2), (128, 2))  # (routed experts, expert-parallel ranks)
Routing = Callable[[jax.Array, int, int], jax.Array]  # (key, tokens, experts) -> expert ids [tokens, k]


def uniform_random(key: jax.Array, tokens: int, experts: int) -> jax.Array:
    """Top-8 distinct experts drawn uniformly per token."""
    return jnp.argsort(jax.random.uniform(key, (tokens, experts)), axis=-1)[:, :TOP_K].astype(jnp.int32)


def routed(n_groups: int, topk_groups: int) -> Routing:
    """`route` on random normal logits (no bias) under DeepSeek-V3's router settings."""

    def ids(key: jax.Array, tokens: int, experts: int) -> jax.Array:
        cfg = RoutingConfig(num_experts=experts, top_k=TOP_K, n_groups=n_groups, topk_groups=topk_groups)
        return route(jax.random.normal(key, (tokens, experts)), jnp.zeros(experts), cfg).indices

    return ids


ROUTINGS: dict[str, Routing] = {
    "uniform random": uniform_random,
    "route(), no group limit": routed(1, 1),
    "route(), 8 groups / top-4": routed(8, 4),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens over all ranks (a multiple of 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    print(
        f"{args.tokens} tokens, top-{TOP_K}, hidden {HIDDEN}, BF16; "
        "dispatch direction only; counted from routing decisions, not timed.\n"
    )
    print(
        "| routing | experts | EP | local experts | rows/token sent, no dedup | with dedup | KiB/token, no dedup | "
        "with dedup | dedup factor |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, make in ROUTINGS.items():
        for experts, ranks in SETUPS:
            ids = make(jax.random.key(args.seed), args.tokens, experts)
            plain, dedup = (
                dispatch_bytes_per_token(ids, experts, ranks, HIDDEN, BF16_BYTES, dedup=d) for d in (False, True)
            )
            row = HIDDEN * BF16_BYTES
            print(
                f"| {name} | {experts} | {ranks} | {experts // ranks} | {plain / row:.2f} | {dedup / row:.2f} | "
                f"{plain / 1024:.1f} | {dedup / 1024:.1f} | {plain / dedup:.2f}x |"
            )


if __name__ == "__main__":
    main()
