"""Time the expert-parallel receive side (forward + backward) on one GPU, at one EP8 rank's shapes.

What a rank of the 671B recipes runs between the two exchanges (`moe/receive.expand_reduce`): M received
rows, each with S expert slots of which about one is this rank's at EP8, sorted into the grouped GEMMs
and summed back per row. Two formulations of the same function are timed against each other:
- `sorted`: what the block runs, each sorted copy gathering its row and each row gathering its copies'
  weighted outputs, with gathers for gradients too;
- `every_slot`: the direct one, a row for every slot ([M x S, D] repeated, masked and summed over the
  slots), S times the rows a rank computes, which XLA kept as a 14 GiB buffer in the H100 recipe's step.
Each variant compiles for about 70 s on an H200 (4,096 tokens), before it is timed.
Both run the same sort and the same grouped GEMMs (`--backend`, `--fp8`). Rows and slots come from a
random routing of `--tokens` tokens per rank over `--ranks` ranks, top-`--top-k`, deduplicated per rank;
the capacity is the recipes' ragged_buffer_factor 1.25. Median of --iters after --warmup, and the relative
error of y and of every gradient of `every_slot` against `sorted`.

    python benchmarks/bench_receive.py --tokens 16384 24576 --out receive.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from bench_moe_layer import print_runs, rel, time_fn

from maxtext_moe.moe import receive
from maxtext_moe.moe.gemm import select_te_grouped_gemm_path
from maxtext_moe.moe.layer import expert_mlp_on_copies, sort_by_expert
from maxtext_moe.moe.settings import ExpertPath

BUFFER_FACTOR = 1.25


def every_slot(x, row_experts, row_weights, experts, path, copies_cap):
    """The receive side through a row for every slot: repeat, sort, unsort, mask, weighted sum over slots."""
    rows, slots = row_experts.shape
    num_local = experts["wi_0"].shape[0]
    flat = row_experts.reshape(-1)
    valid = (flat >= 0) & (flat < num_local)
    order, inverse, sizes = sort_by_expert(jnp.where(valid, flat, num_local), num_local + 1, check=False)
    order, inverse = order[:copies_cap], jnp.where(inverse < copies_cap, inverse, copies_cap)
    out = expert_mlp_on_copies(
        jnp.repeat(x, slots, axis=0), order, inverse, sizes[:num_local], experts, path, partial=True
    )
    out = jnp.where(valid[:, None], out, 0).reshape(rows, slots, -1)
    return jnp.einsum("msd,ms->md", out, row_weights.astype(x.dtype), preferred_element_type=jnp.float32)


def receive_inputs(key: jax.Array, tokens: int, ranks: int, top_k: int, local: int) -> tuple[jax.Array, jax.Array, int]:
    """Slots of the rows one rank receives when `ranks` ranks each send `tokens` tokens routed top-k over
    ranks x local experts, once per destination rank: (row_experts [M, S] with -1 for another rank's
    expert, row_weights [M, S], the copies cap). M is the worst case capped at 1.25x balanced, as the recipes."""
    experts = ranks * local
    scores = jax.random.uniform(key, (ranks * tokens, experts))
    chosen = jax.lax.top_k(scores, top_k)[1]  # [ranks * tokens, k]
    mine = chosen < local  # this rank holds experts [0, local)
    row = jnp.any(mine, axis=1)
    slots = min(top_k, local)
    rows = min(ranks * tokens, int(BUFFER_FACTOR * tokens * min(top_k, ranks)))
    order = jnp.argsort(~row, stable=True)[:rows]  # the rows this rank receives first, then empty ones
    row_experts = jnp.where(mine, chosen, -1)[order]
    row_experts = jnp.sort(row_experts, axis=1)[:, ::-1][:, :slots]
    row_experts = jnp.where(row[order][:, None], row_experts, -1)
    weights = jnp.where(row_experts >= 0, jax.random.uniform(jax.random.fold_in(key, 1), row_experts.shape), 0)
    return row_experts, weights, int(BUFFER_FACTOR * tokens * top_k)


def receive_case(
    key: jax.Array, tokens: int, ranks: int, top_k: int, local: int, emb: int, mlp: int
) -> tuple[jax.Array, dict[str, jax.Array], jax.Array, jax.Array, int]:
    """One rank's receive side in BF16: (received rows [M, emb], its `local` experts' weights, then what
    `receive_inputs` gives: row_experts, row_weights, the copies cap)."""
    row_experts, row_weights, cap = receive_inputs(key, tokens, ranks, top_k, local)
    ks = jax.random.split(jax.random.fold_in(key, 2), 5)
    x = jax.random.normal(ks[0], (row_experts.shape[0], emb), jnp.bfloat16)
    shapes = ((emb, mlp), (emb, mlp), (mlp, emb))
    experts = {
        n: (jax.random.normal(k, (local, *shape), jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)
        for n, k, shape in zip(("wi_0", "wi_1", "wo"), ks[2:], shapes, strict=True)
    }
    return x, experts, row_experts, row_weights, cap


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure(tokens: int, a: argparse.Namespace, path: ExpertPath) -> list[dict[str, Any]]:
    """Both formulations at `tokens` tokens per sending rank: one run each, the second with its errors."""
    key = jax.random.key(tokens)
    x, experts, row_experts, row_weights, cap = receive_case(key, tokens, a.ranks, a.top_k, a.experts, a.emb, a.mlp)
    rows, slots = row_experts.shape
    cot = jax.random.normal(jax.random.split(jax.random.fold_in(key, 2), 5)[1], (rows, a.emb), jnp.float32)
    variants = {
        "sorted": lambda x, e, w: receive.expand_reduce(x, row_experts, w, e, path, cap)[0],
        "every_slot": lambda x, e, w: every_slot(x, row_experts, w, e, path, cap),
    }
    runs, outputs = [], {}
    for name, fn in variants.items():
        step = jax.jit(jax.value_and_grad(lambda x, e, w, fn=fn: jnp.sum(fn(x, e, w) * cot), (0, 1, 2)))
        run: dict[str, Any] = {"variant": name, "tokens": tokens, "rows": rows, "slots": slots}
        try:
            say(f"{name}, {tokens} tokens: {rows} rows x {slots} slots, compiling")
            t0 = time.perf_counter()
            compiled = step.lower(x, experts, row_weights).compile()
            run["compile_s"] = time.perf_counter() - t0
            run["temp_gib"] = compiled.memory_analysis().temp_size_in_bytes / 2**30
            say(f"{name}, {tokens} tokens: compiled in {run['compile_s']:.0f} s, timing")
            outputs[name] = jax.block_until_ready(compiled(x, experts, row_weights))
            run.update(time_fn(lambda: compiled(x, experts, row_weights), a.warmup, a.iters))  # noqa: B023
        except Exception as e:  # noqa: BLE001 - recorded in the JSON, the other variant still runs
            run["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        runs.append(run)
        print(json.dumps(run), flush=True)
    if len(outputs) == 2:
        (va, ga), (vb, gb) = outputs["every_slot"], outputs["sorted"]
        runs[-1]["rel_err_loss"] = abs(float(va - vb)) / abs(float(vb))
        runs[-1]["rel_err_grads_max"] = max(
            rel(p, q) for p, q in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True)
        )
    return runs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384], help="tokens each rank sends")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32, help="experts on this rank")
    ap.add_argument("--emb", type=int, default=7168)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--backend", default="te")
    ap.add_argument("--fp8", default="none")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    path = ExpertPath(backend=a.backend, fp8=a.fp8)
    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": vars(a)}
    if a.backend == "te":
        result["te_grouped_gemm_path"] = select_te_grouped_gemm_path()
    result["runs"] = []
    for tokens in a.tokens:
        result["runs"] += measure(tokens, a, path)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    print_runs(
        result["runs"],
        11,
        f"{'rows x slots':>13} {'median ms':>10} {'temp GiB':>9}",
        lambda r: f"{r['rows']:>7} x {r['slots']:<3} {r['median_ms']:>10.2f} {r['temp_gib']:>9.2f}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
