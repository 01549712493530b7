"""Time the MoE layer (forward + backward) per grouped-GEMM backend, and MaxText's own block, on one GPU.

The yardstick: DeepSeek-V3 widths (emb 7168, expert width 2048, top-8), 32 local experts (the expert
work of one EP8 rank), BF16, random inputs and parameters (never zeros). For each token count it times
`jax.grad` of sum(y * cotangent) with respect to the input and all parameters, synchronised, median of
--iters after --warmup calls; TFLOP/s from counted matmul FLOPs (router, routed experts at top-k, shared
expert; x3 for forward + backward); relative error of y and dL/dx against the float32 dense reference.
`te_fp8` is TE's grouped GEMM with FP8 current scaling (`moe.fp8: current_scaling`; groups padded to 16
rows); its TFLOP/s counts the same matmul FLOPs (compare with the FP8 peak, 1,979 on an H200).

    python benchmarks/bench_moe_layer.py --tokens 8192 16384 --backends te te_fp8 --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_moe.moe.gemm import BACKENDS, Backend, Fp8, select_te_grouped_gemm_path
from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.reference import moe_reference
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath

SEQ = 4096  # MaxText's block takes [batch, seq, emb]; tokens = batch * SEQ
# --backends names: each grouped-GEMM backend as is, and TE with FP8 current scaling.
VARIANTS: dict[str, tuple[Backend, Fp8]] = {**{b: (b, "none") for b in BACKENDS}, "te_fp8": ("te", "current_scaling")}


def layer_flops(cfg: MoEConfig, tokens: int) -> float:
    """Matmul FLOPs of forward + backward (3x forward): router, k routed experts and the shared expert."""
    r = cfg.routing
    per_token = 2 * cfg.emb_dim * (r.num_experts + 3 * r.top_k * cfg.moe_mlp_dim + 3 * cfg.shared_mlp_dim)
    return 3.0 * per_token * tokens


def rel(a: jax.Array, b: jax.Array) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def time_fn(fn: Callable[[], Any], warmup: int, iters: int) -> dict[str, float]:
    """Median wall time in ms of a synchronised call, after `warmup` calls (compiled already by the check)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "iters": iters}


def print_runs(runs: list[dict[str, Any]], width: int, header: str, row: Callable[[dict[str, Any]], str]) -> None:
    """The runs as a table after the JSON: variant and tokens, then `row`'s columns, or a failed run's error."""
    print(f"\n{'variant':{width}} {'tokens':>6} {header}")
    for r in runs:
        lead = f"{r['variant']:{width}} {r['tokens']:>6}"
        print(f"{lead} ERROR {r['error'][:80]}" if "error" in r else f"{lead} {row(r)}")


def grad_fn(forward: Callable[[Any, jax.Array], jax.Array]) -> Callable:
    """jit(grad) of sum(forward(params, x) * cot) in params and x, called as (params, x, cot); also returns y for
    the error check. The cotangent is an argument: closed over, it would be a literal in the HLO, and XLA would
    fold what reads it (the amax of an FP8 output gradient) at compile time instead of timing it."""

    def loss(p: Any, x: jax.Array, cot: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = forward(p, x)
        return jnp.sum(y.astype(jnp.float32) * cot), y

    return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--backends", nargs="+", default=["te", "tokamax", "ragged_dot"], choices=list(VARIANTS))
    ap.add_argument(
        "--maxtext",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time MaxText's RoutedAndSharedMoE (sparse_matmul, use_tokamax_gmm=true)",
    )
    ap.add_argument(
        "--ragged-dot-max-tokens",
        type=int,
        default=8192,
        help="skip jax.lax.ragged_dot above this many tokens (about 23 TFLOP/s on an H200)",
    )
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--emb", type=int, default=7168)
    ap.add_argument("--mlp", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--groups", type=int, nargs=2, default=[8, 4], metavar=("N_GROUPS", "TOPK_GROUPS"))
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--te-path", default="auto", choices=["auto", "v1", "v2"])
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    cfg = MoEConfig(
        emb_dim=a.emb,
        moe_mlp_dim=a.mlp,
        shared_mlp_dim=a.mlp,
        check_dropless=False,
        routing=RoutingConfig(a.experts, a.top_k, a.groups[0], a.groups[1], 2.5),
    )
    dev = jax.devices()[0]
    result: dict[str, Any] = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "config": vars(a),
        "check_dropless": False,
        "runs": [],
    }
    if any(VARIANTS[b][0] == "te" for b in a.backends):
        result["te_grouped_gemm_path"] = select_te_grouped_gemm_path(a.te_path)

    def save() -> None:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    for tokens in a.tokens:
        if tokens % SEQ:
            raise SystemExit(f"--tokens must be multiples of {SEQ}")
        params = init_params(jax.random.key(tokens), cfg, jnp.bfloat16)
        x = jax.random.normal(jax.random.key(tokens + 1), (tokens // SEQ, SEQ, cfg.emb_dim), jnp.bfloat16)
        cot = jax.random.normal(jax.random.key(tokens + 2), x.shape, jnp.float32)
        ref_grad = grad_fn(lambda p, x: moe_reference(p, x, cfg))
        (_, dx_ref), y_ref = ref_grad(params, x.astype(jnp.float32), cot)
        counts = np.asarray(jax.jit(lambda p, x: moe_forward(p, x, cfg)[1].counts)(params, x))
        flops = layer_flops(cfg, tokens)

        variants: list[tuple[str, Callable, Any]] = []
        for name in a.backends:
            backend, fp8 = VARIANTS[name]
            if backend == "ragged_dot" and tokens > a.ragged_dot_max_tokens:
                continue
            path = ExpertPath(backend=backend, fp8=fp8)
            variants.append((f"ours/{name}", lambda p, x, path=path: moe_forward(p, x, cfg, path)[0], params))
        if a.maxtext:
            from maxtext_moe.upstream.maxtext_block import maxtext_moe_fn

            fn, state = maxtext_moe_fn(
                cfg, params, batch=tokens // SEQ, seq=SEQ, dtype="bfloat16", use_tokamax_gmm=True
            )
            variants.append(("maxtext/tokamax", fn, state))

        for name, forward, p in variants:
            run: dict[str, Any] = {
                "variant": name,
                "tokens": tokens,
                "tflop": flops / 1e12,
                "expert_load_min_max": [int(counts.min()), int(counts.max())],
            }
            try:
                step = grad_fn(forward)
                (_, dx), y = step(p, x, cot)
                run.update(
                    rel_err_y=rel(y, y_ref),
                    rel_err_dx=rel(dx, dx_ref),
                    finite=bool(jnp.isfinite(y.astype(jnp.float32)).all() & jnp.isfinite(dx.astype(jnp.float32)).all()),
                )
                iters = a.iters if "ragged_dot" not in name else max(2, a.iters // 4)
                run.update(time_fn(lambda step=step, p=p, x=x, cot=cot: step(p, x, cot), a.warmup, iters))
                run["tflops"] = flops / (run["median_ms"] * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - recorded in the JSON, the other variants still run
                run["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            result["runs"].append(run)
            save()
            print(json.dumps(run), flush=True)

    print_runs(
        result["runs"],
        18,
        f"{'median ms':>10} {'TFLOP/s':>8} {'rel y':>9} {'rel dx':>9}",
        lambda r: f"{r['median_ms']:>10.2f} {r['tflops']:>8.1f} {r['rel_err_y']:>9.2e} {r['rel_err_dx']:>9.2e}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
