"""One process of `test_nccl_ep_gpu.py` (one GPU each, `jax.distributed` from the JAX_* variables): our EP
layer with `moe.exchange` nccl_ep against the same layer with XLA's all-to-all, then a routing that overflows
NCCL EP's receive buffer. Process 0 writes the findings as JSON to argv[1]; the test asserts on them."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import expert_parallel, nccl_ep
from maxtext_moe.moe.layer import MoEConfig, init_params
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import EP_AXIS, ExpertPath
from maxtext_moe.run import distributed

CFG = MoEConfig(
    emb_dim=256,
    moe_mlp_dim=128,
    shared_mlp_dim=128,
    check_dropless=False,
    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
)
TOKENS_PER_RANK = 1024
# Receive capacity 1.5x the balanced load (TE's rule, 6144 rows here, worst case 9216): random routing fits,
# every token sent to rank 0's experts (8192 rows there) does not.
BUFFER_FACTOR = 1.5


def rel(a: jax.Array, b: jax.Array) -> float:
    """Relative L2 difference; 0 when equal (the selection bias has no gradient on either path)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return 0.0 if np.array_equal(a, b) else float(np.linalg.norm(a - b) / np.linalg.norm(b))


def put(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def whole(tree):
    return jax.tree.map(lambda a: np.asarray(multihost_utils.process_allgather(a, tiled=True)), tree)


def main(out: str) -> int:
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    leader = distributed.initialize(None).is_leader
    mesh = Mesh(np.array(jax.devices()), (EP_AXIS,))
    ranks = mesh.shape[EP_AXIS]
    params = init_params(jax.random.key(0), CFG, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (ranks * TOKENS_PER_RANK, CFG.emb_dim), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    found: dict = {"ranks": ranks}
    with global_shard_guard(MeshResource(ep_resource=EP_AXIS)), jax.set_mesh(mesh), mesh:
        found["bootstrap"] = repr(
            nccl_ep.bootstrap(
                mesh,
                num_experts=CFG.routing.num_experts,
                top_k=CFG.routing.top_k,
                max_tokens_per_rank=TOKENS_PER_RANK,
                hidden_dim=CFG.emb_dim,
                buffer_factor=BUFFER_FACTOR,
            )
        )
        split = {k: P(EP_AXIS) if k in ("wi_0", "wi_1", "wo") else P() for k in params["MoeBlock_0"]}
        sharded = {
            "MoeBlock_0": {k: put(v, NamedSharding(mesh, split[k])) for k, v in params["MoeBlock_0"].items()},
            "shared_experts": jax.tree.map(lambda v: put(v, NamedSharding(mesh, P())), params["shared_experts"]),
        }
        xs = put(x, NamedSharding(mesh, P(EP_AXIS)))
        cots = put(cot, NamedSharding(mesh, P(EP_AXIS)))

        def run(path: ExpertPath, p) -> tuple:
            def loss(p, x):
                y = expert_parallel.ep_moe_forward_sharded(p, x, CFG, mesh, path)[0]
                return jnp.sum(y.astype(jnp.float32) * cots), y

            (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(p, xs)
            return whole((y, grads))

        ours = run(ExpertPath(exchange="nccl_ep", buffer_factor=BUFFER_FACTOR), sharded)
        ref = run(ExpertPath(exchange="all_to_all"), sharded)
        found["rel_y"] = rel(ours[0], ref[0])
        found["rel_grads"] = {
            jax.tree_util.keystr(path): rel(a, b)
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ours[1]), jax.tree.leaves(ref[1]), strict=True)
        }
        found["finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all() for a in jax.tree.leaves(ours)))
        # Every token to experts 0-3, all on rank 0: 2 x 1024 tokens x 4 rows > its 6144-row buffer.
        bias = jnp.where(jnp.arange(CFG.routing.num_experts) < CFG.routing.top_k, 100.0, -100.0)
        skewed = dict(sharded, MoeBlock_0=dict(sharded["MoeBlock_0"]))
        skewed["MoeBlock_0"]["gate"] = {
            "kernel": sharded["MoeBlock_0"]["gate"]["kernel"],
            "bias": put(bias.astype(jnp.bfloat16), NamedSharding(mesh, P())),
        }
        try:
            run(ExpertPath(exchange="nccl_ep", buffer_factor=BUFFER_FACTOR), skewed)
            found["overflow_error"] = None
        except Exception as e:  # noqa: BLE001 - the error the guard raises through XLA is the finding
            found["overflow_error"] = f"{type(e).__name__}: {e}"
    if leader:
        with open(out, "w") as f:
            json.dump(found, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
