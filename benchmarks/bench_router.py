"""Time the router's gate GEMM of the DeepSeek-V3 proxy forward and backward: the layer's `gate_logits` against
the same float32 dot at `Precision.HIGHEST`.

Why: the router's logits are float32 so that near-ties route alike everywhere, and a float32 dot at HIGHEST runs
on a GPU's CUDA cores rather than its tensor cores. The step runs this GEMM forward, again in its
rematerialization, and for both gradients, in every MoE layer; `bench --profile` pools it with the dense GEMMs.
This script times one layer's worth at the proxy's token count, each variant checked first against a float64
product of the same BF16 inputs: the logits, and both gradients (BF16, as the inputs they are the gradients of).

`--tokens`, `--width` and `--experts` shrink it for the CPU (the tests run it there).

    python benchmarks/bench_router.py --tokens 32768 --out router.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_moe_layer import time_fn

from maxtext_moe.moe.layer import gate_logits

VARIANTS = {
    "layer": gate_logits,
    "f32_highest": lambda x, w: jnp.dot(
        x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    ),
}


def run_one(variant: str, tokens: int, width: int, experts: int, warmup: int, iters: int) -> dict[str, Any]:
    """Forward and both gradients of sum(sigmoid(logits) * cot), the sigmoid as the router applies it."""
    logits_fn = VARIANTS[variant]
    kx, kw, kc = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (tokens, width), jnp.bfloat16)
    w = (jax.random.normal(kw, (width, experts)) * width**-0.5).astype(jnp.bfloat16)
    cot = jax.random.normal(kc, (tokens, experts), jnp.float32)

    def loss(x: jax.Array, w: jax.Array, cot: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = logits_fn(x, w)
        return jnp.sum(jax.nn.sigmoid(logits) * cot), logits

    step = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (dx, dw), logits = step(x, w, cot)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)  # 1.9 GB at the proxy's size
    exact = x64 @ w64
    s = 1.0 / (1.0 + np.exp(-exact))
    dlogits = np.asarray(cot, np.float64) * s * (1.0 - s)

    def rel(a: jax.Array, b: np.ndarray) -> float:
        return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))

    timed = time_fn(lambda: step(x, w, cot), warmup, iters)
    return {
        "variant": variant,
        "tokens": tokens,
        "width": width,
        "experts": experts,
        **timed,
        "rel_err_logits": rel(logits, exact),
        "rel_err_dx": rel(dx, dlogits @ w64.T),
        "rel_err_dw": rel(dw, x64.T @ dlogits),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8 * 4096, help="batch x sequence")
    ap.add_argument("--width", type=int, default=7168, help="the model's hidden width")
    ap.add_argument("--experts", type=int, default=32, help="routed experts on the GPU (the proxy's 32)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    runs = [run_one(v, a.tokens, a.width, a.experts, a.warmup, a.iters) for v in VARIANTS]
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "config": vars(a), "runs": runs}
    result["layer_over_f32_highest"] = runs[0]["median_ms"] / runs[1]["median_ms"]
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    for r in runs:
        print(
            f"{r['variant']:12} {r['median_ms']:8.3f} ms (min {r['min_ms']:.3f})  rel err logits "
            f"{r['rel_err_logits']:.1e} dx {r['rel_err_dx']:.1e} dw {r['rel_err_dw']:.1e}"
        )
    print(f"layer / f32_highest: {result['layer_over_f32_highest']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
