"""Dense per-expert float32 reference of `layer.moe_forward`, for tests and benchmarks only.

It shares the routing (`routing.route`) and computes every expert on every token, weighting by the
combine weight (zero where the token did not choose the expert): E/k times the layer's FLOPs, no
sorting, no grouped GEMM, so it checks the sort/unsort and each backend independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_moe.moe.layer import MoEConfig, Params, gate_logits, shared_expert, up_weights
from maxtext_moe.moe.routing import route

_HI = jax.lax.Precision.HIGHEST


def moe_reference(params: Params, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    """float32 output of the MoE layer on `x` [..., emb_dim]; parameters are upcast to float32."""
    p32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
    p = p32["MoeBlock_0"]
    tokens = x.reshape(-1, cfg.emb_dim).astype(jnp.float32)
    r = route(gate_logits(tokens, p["gate"]["kernel"]), p["gate"]["bias"], cfg.routing)
    combine = jnp.zeros((tokens.shape[0], cfg.routing.num_experts), jnp.float32)
    combine = combine.at[jnp.arange(tokens.shape[0])[:, None], r.indices].add(r.weights)

    def one_expert(carry: jax.Array, expert: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        wi_0, wi_1, wo, weight = expert
        h = jax.nn.silu(jnp.dot(tokens, wi_0, precision=_HI)) * jnp.dot(tokens, wi_1, precision=_HI)
        return carry + weight[:, None] * jnp.dot(h, wo, precision=_HI), None

    wi_0, wi_1 = jnp.split(up_weights(p), 2, axis=-1)
    experts = (wi_0, wi_1, p["wo"], combine.T)
    routed, _ = jax.lax.scan(one_expert, jnp.zeros_like(tokens), experts)
    with jax.default_matmul_precision("highest"):
        y = routed + shared_expert(tokens, p32["shared_experts"])
    return y.reshape(x.shape)
