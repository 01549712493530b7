"""Time each dense projection of the DeepSeek-V3 proxy forward and backward, in BF16 and in TE's FP8, alone.

Why: the FP8 recipe runs every dense GEMM through TE's per-tensor current scaling, which reads each operand
once for its amax and again for its cast, the gradient too. For a GEMM with a narrow side (MLA's key-value
projections: 512 in, or 576 out) that traffic can cost more than FP8 saves on the matmul. `bench --profile`
sees the casts of all GEMMs pooled; this script times each projection at the proxy's token count as the step
runs it (XLA's dot for BF16, `transformer_engine.jax.dense.dense` for FP8), so the projections worth keeping in
BF16 can be named. The sum over projections weights each by how often one step runs it (`count`: six
attention layers, five shared experts, one dense MLP, one MTP input projection).

Before timing, the output and both gradients are checked against a float32 reference on the same inputs.
`--variants bf16` runs anywhere (the tests run it on the CPU, shapes divided by `--shrink`); `te_fp8` needs TE.

    python benchmarks/bench_dense_fp8.py --tokens 32768 --out dense.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from bench_moe_layer import grad_fn, rel, time_fn

# name, input width, output width, times one proxy step runs it (1 dense + 4 MoE + 1 MTP layer)
PROJECTIONS = (
    ("wq_a", 7168, 1536, 6),
    ("wq_b", 1536, 128 * 192, 6),
    ("wkv_a", 7168, 512 + 64, 6),
    ("wkv_b", 512, 128 * (128 + 128), 6),
    ("attention_out", 128 * 128, 7168, 6),
    ("shared_wi", 7168, 2048, 10),
    ("shared_wo", 2048, 7168, 5),
    ("dense_wi", 7168, 18432, 2),
    ("dense_wo", 18432, 7168, 1),
    ("mtp_projection", 2 * 7168, 7168, 1),
)
VARIANTS = ("bf16", "te_fp8")


def projection_fn(variant: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """y = x @ w in `variant`, as the recipes run it: XLA's dot in BF16, or TE's dense with current scaling
    (E4M3 forward, E5M2 gradients: what MaxText's `quantization: te_fp8_currentscaling` builds)."""
    if variant == "bf16":
        return lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))
    if variant == "te_fp8":
        from transformer_engine.jax import dense, quantize

        def fp8(x: jax.Array, w: jax.Array) -> jax.Array:
            quantizers = quantize.QuantizerFactory.create_set(
                scaling_mode=quantize.ScalingMode.CURRENT_TENSOR_SCALING,
                fwd_dtype=jnp.float8_e4m3fn,
                bwd_dtype=jnp.float8_e5m2,
            )
            return dense.dense(x, w, contracting_dims=((1,), (0,)), quantizer_set=quantizers)

        return fp8
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")


def run_one(variant: str, name: str, m: int, k: int, n: int, count: int, warmup: int, iters: int) -> dict[str, Any]:
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    project = projection_fn(variant)
    rows = min(m, 1024)  # the check on the first rows: a float32 copy of every operand would not fit beside them
    step = grad_fn(lambda w, x: project(x, w))
    (dw, dx), y = step(w, x[:rows], cot[:rows])
    x32, w32 = x[:rows].astype(jnp.float32), w.astype(jnp.float32)
    (dw_ref, dx_ref), y_ref = grad_fn(lambda w, x: x @ w)(w32, x32, cot[:rows].astype(jnp.float32))
    timed = time_fn(lambda: step(w, x, cot), warmup, iters)
    flops = 3 * 2.0 * m * k * n  # forward, input gradient, weight gradient
    return {
        "variant": variant,
        "name": name,
        "m": m,
        "k": k,
        "n": n,
        "count": count,
        **timed,
        "tflops": flops / (timed["median_ms"] * 1e-3) / 1e12,
        "rel_err_out": rel(y, y_ref),
        "rel_err_dx": rel(dx, dx_ref),
        "rel_err_dw": rel(dw, dw_ref),
    }


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per projection timed in both variants: FP8's time over BF16's, and the ms a step gains by running it in
    FP8 (negative where BF16 is faster), weighted by `count`."""
    by = {(r["name"], r["variant"]): r for r in runs if "error" not in r}
    out = []
    for name, *_ in PROJECTIONS:
        bf16, fp8 = by.get((name, "bf16")), by.get((name, "te_fp8"))
        if bf16 and fp8:
            out.append({
                "name": name,
                "fp8_over_bf16": fp8["median_ms"] / bf16["median_ms"],
                "step_ms_saved_by_fp8": (bf16["median_ms"] - fp8["median_ms"]) * bf16["count"],
            })  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="rows of each GEMM: batch x sequence")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--only", default="", help="comma-separated projection names (default: all)")
    ap.add_argument("--shrink", type=int, default=1, help="divide every width by this (tests on the CPU)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    only = set(filter(None, a.only.split(",")))
    runs: list[dict[str, Any]] = []
    for name, k, n, count in PROJECTIONS:
        if only and name not in only:
            continue
        for variant in a.variants.split(","):
            try:
                run = run_one(variant, name, a.tokens, k // a.shrink, n // a.shrink, count, a.warmup, a.iters)
            except Exception as e:  # noqa: BLE001  # one failing kernel should not hide the others' figures
                run = {"variant": variant, "name": name, "error": f"{type(e).__name__}: {e}"}
            runs.append(run)
            print(
                f"{name:15} {variant:7} "
                + (f"ERROR {run['error'][:100]}" if "error" in run else
                   f"{run['median_ms']:8.3f} ms {run['tflops']:6.0f} TFLOP/s  rel err out "
                   f"{run['rel_err_out']:.1e} dx {run['rel_err_dx']:.1e} dw {run['rel_err_dw']:.1e}"),
                flush=True,
            )  # fmt: skip
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": vars(a), "runs": runs}
    result["fp8_vs_bf16"] = compare(runs)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for c in result["fp8_vs_bf16"]:
        saved = c["step_ms_saved_by_fp8"]
        print(f"{c['name']:15} FP8/BF16 {c['fp8_over_bf16']:.2f}  a step saves {saved:+.2f} ms in FP8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
