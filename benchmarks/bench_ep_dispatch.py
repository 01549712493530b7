"""Expert-parallel MoE layer over every device of the job: the exchange with and without dedup, timed.

It measures the bytes a token sends in the EP dispatch with and without per-destination-rank dedup,
on two GPUs, where the exchange is the real `jax.lax.ragged_all_to_all` over NVLink. This script runs
`expert_parallel.ep_moe_forward_sharded` (routing, plan, exchange, grouped GEMMs, exchange back, shared expert)
forward + backward on DeepSeek-V3 widths with the tokens and experts split over all devices, once sending
a row per (token, chosen expert) as MaxText does ("no dedup") and once per (token, destination rank)
("dedup"). For each it reports the median step, the rows and KiB per token that cross ranks (counted
from the routing the run itself chose, by the plan the layer uses), the rows the exchange puts on the wire
per token (`--impl all_to_all`, the default: (R - 1) blocks of padded rows per rank, so dedup also
shrinks the padding), and the relative difference to the same layer on one device (float32 outputs and
input gradient). "all_to_all" and "emulated" run on CPU devices too: that is how the tests exercise it.

`--impl nccl_ep` runs the layer through TE's NCCL EP (`moe/nccl_ep.py`: one process per GPU, BF16, TE and
NCCL >= 2.30.4), bootstrapped once for the run; NCCL EP deduplicates by itself, so it runs once, and the bytes
reported are our dedup plan's count for the same routing, not NCCL's own wire traffic.

One process may drive every device, or one process each (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID, JAX_LOCAL_DEVICE_IDS as `maxtext-moe train` reads them): on two H200s one process for both
GPUs waited forever in the first all-to-all, as the proxy did. Process 0 prints and writes `--out`.

    python benchmarks/bench_ep_dispatch.py --tokens-per-device 8192 --experts 64 --backend te --out ep.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe_layer import grad_fn, layer_flops, rel, time_fn
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, Sharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import expert_parallel, nccl_ep, send_plan
from maxtext_moe.moe.gemm import BACKENDS
from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import EP_AXIS, IMPLS, ExpertPath
from maxtext_moe.run import distributed


def put(x: jax.Array, sharding: Sharding) -> jax.Array:
    """`x` (the same on every process) as one array over the job's devices; `device_put` would need every
    device to be this process's."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Experts split over the expert axis on their first dimension, everything else replicated."""

    def place(path: tuple, leaf: jax.Array) -> jax.Array:
        name = jax.tree_util.keystr(path)
        split = "MoeBlock_0" in name and "gate" not in name
        return put(leaf, NamedSharding(mesh, P(EP_AXIS) if split else P()))

    return jax.tree_util.tree_map_with_path(place, params)


def whole(x: jax.Array) -> jax.Array:
    """Every process's shards of `x` gathered, so each process holds all of it."""
    return jnp.asarray(multihost_utils.process_allgather(x, tiled=True))


@contextlib.contextmanager
def nccl_ep_started(a: argparse.Namespace, mesh: Mesh) -> Iterator[None]:
    """For `--impl nccl_ep`: TE's mesh resource with the expert axis, and NCCL EP bootstrapped for this run."""
    if a.impl != "nccl_ep":
        yield
        return
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    with global_shard_guard(MeshResource(ep_resource=EP_AXIS)), jax.set_mesh(mesh), mesh:
        sizes = dict(num_experts=a.experts, top_k=a.top_k, hidden_dim=a.emb, buffer_factor=a.buffer_factor)
        nccl_ep.bootstrap(mesh, max_tokens_per_rank=a.tokens_per_device, **sizes)
        yield


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-device", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=64, help="routed experts over all devices")
    ap.add_argument("--emb", type=int, default=7168)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--groups", type=int, nargs=2, default=[8, 4], metavar=("N_GROUPS", "TOPK_GROUPS"))
    ap.add_argument("--backend", default="te", choices=list(BACKENDS))
    ap.add_argument("--impl", default="all_to_all", choices=list(IMPLS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument(
        "--buffer-factor",
        type=float,
        default=-1.0,
        help="ragged_buffer_factor: receive rows and expert copies per device as a multiple of the "
        "balanced load (-1: the dropless worst case)",
    )
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    leader = distributed.initialize(None).is_leader
    devices = jax.devices()
    ranks = len(devices)
    if ranks < 2:
        raise SystemExit(f"needs 2 or more devices, found {ranks}")
    mesh = Mesh(np.array(devices), (EP_AXIS,))
    cfg = MoEConfig(
        emb_dim=a.emb,
        moe_mlp_dim=a.mlp,
        shared_mlp_dim=a.mlp,
        check_dropless=False,
        routing=RoutingConfig(a.experts, a.top_k, a.groups[0], a.groups[1], 2.5),
    )
    dtype = jnp.dtype(a.dtype)
    tokens = a.tokens_per_device * ranks
    params = init_params(jax.random.key(0), cfg, dtype)
    x = jax.random.normal(jax.random.key(1), (tokens, cfg.emb_dim), dtype)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)

    (_, dx_one), y_one = grad_fn(lambda p, x: moe_forward(p, x, cfg, ExpertPath(backend=a.backend))[0])(params, x, cot)
    sharded_params = shard_params(params, mesh)
    x_sharded = put(x, NamedSharding(mesh, P(EP_AXIS)))
    cot_sharded = put(cot, NamedSharding(mesh, P(EP_AXIS)))  # beside x: the timed step copies neither
    result: dict[str, Any] = {
        "devices": [d.device_kind for d in devices],
        "jax": jax.__version__,
        "config": vars(a),
        "check_dropless": False,
        "runs": [],
    }
    with nccl_ep_started(a, mesh):
        run_all(a, mesh, cfg, sharded_params, x_sharded, cot_sharded, (y_one, dx_one), result, leader)
    if len(result["runs"]) == 2:
        plain, dedup_run = result["runs"]
        result["dedup_bytes_factor"] = plain["kib_per_token_sent"] / dedup_run["kib_per_token_sent"]
        result["dedup_speedup"] = plain["median_ms"] / dedup_run["median_ms"]
    result["processes"] = jax.process_count()
    if not leader:
        return 0
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    report(a, ranks, result)
    return 0


def run_all(
    a: argparse.Namespace,
    mesh: Mesh,
    cfg: MoEConfig,
    sharded_params: Any,
    x_sharded: jax.Array,
    cot: jax.Array,
    one_device: tuple[jax.Array, jax.Array],
    result: dict[str, Any],
    leader: bool,
) -> None:
    """The layer with and without dedup (NCCL EP: once), timed; each run appended to `result["runs"]`."""
    y_one, dx_one = one_device
    ranks, dtype = mesh.shape[EP_AXIS], jnp.dtype(a.dtype)
    flops = layer_flops(cfg, a.tokens_per_device)
    for dedup in (True,) if a.impl == "nccl_ep" else (False, True):
        forward = functools.partial(
            expert_parallel.ep_moe_forward_sharded,
            cfg=cfg,
            mesh=mesh,
            path=ExpertPath(backend=a.backend, exchange=a.impl, buffer_factor=a.buffer_factor, dedup=dedup),
        )
        step = grad_fn(lambda p, x, forward=forward: forward(p, x)[0])
        (_, dx), y = step(sharded_params, x_sharded, cot)
        y, dx = whole(y), whole(dx)
        ids = whole(jax.jit(lambda p, x, forward=forward: forward(p, x)[1].indices)(sharded_params, x_sharded))
        sent = send_plan.dispatch_bytes_per_token(ids, a.experts, ranks, a.emb, dtype.itemsize, dedup=dedup)
        run: dict[str, Any] = {
            "dedup": dedup,
            "ranks": ranks,
            "tokens_per_device": a.tokens_per_device,
            "rows_per_token_sent": sent / (a.emb * dtype.itemsize),
            "kib_per_token_sent": sent / 1024,
            "wire_rows_per_token": (ranks - 1)
            * send_plan.peer_rows(a.tokens_per_device, a.top_k, send_plan.local_experts(a.experts, ranks), dedup)
            / a.tokens_per_device
            if a.impl == "all_to_all"
            else None,
            "rel_err_y_vs_one_device": rel(y, y_one),
            "rel_err_dx_vs_one_device": rel(dx, dx_one),
            "finite": bool(jnp.isfinite(y.astype(jnp.float32)).all() & jnp.isfinite(dx.astype(jnp.float32)).all()),
        }
        run.update(time_fn(lambda step=step: step(sharded_params, x_sharded, cot), a.warmup, a.iters))
        run["tflops_per_device"] = flops / (run["median_ms"] * 1e-3) / 1e12
        result["runs"].append(run)
        if leader:
            print(json.dumps(run), flush=True)


def report(a: argparse.Namespace, ranks: int, result: dict[str, Any]) -> None:
    print(
        f"\nEP{ranks} ({jax.process_count()} process(es)), {a.experts} experts, {a.tokens_per_device} tokens/device, "
        f"{a.backend}, {a.impl}, ragged_buffer_factor {a.buffer_factor:g}"
    )
    print(
        f"{'dispatch':9} {'median ms':>10} {'TFLOP/s/dev':>11} {'rows/token':>10} {'KiB/token':>9} "
        f"{'wire rows':>9} {'rel y':>9} {'rel dx':>9}"
    )
    for r in result["runs"]:
        wire = "-" if r["wire_rows_per_token"] is None else f"{r['wire_rows_per_token']:.2f}"
        print(
            f"{'dedup' if r['dedup'] else 'no dedup':9} {r['median_ms']:>10.2f} {r['tflops_per_device']:>11.1f} "
            f"{r['rows_per_token_sent']:>10.2f} {r['kib_per_token_sent']:>9.1f} {wire:>9} "
            f"{r['rel_err_y_vs_one_device']:>9.2e} {r['rel_err_dx_vs_one_device']:>9.2e}"
        )
    if "dedup_bytes_factor" in result:
        print(f"dedup: {result['dedup_bytes_factor']:.2f}x fewer bytes, {result['dedup_speedup']:.2f}x step time")


if __name__ == "__main__":
    sys.exit(main())
