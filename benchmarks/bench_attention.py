"""Time causal attention forward and backward at the proxy's MLA shape: the kernel behind MaxText's
`attention: cudnn_flash_jax`, and the other kernels that take MLA's 192-wide queries with 128-wide values.

Why a benchmark of its own: in `bench --profile` cuDNN's attention is 18% of the BF16 proxy step with its
backward at 36% of the BF16 matmul rate, and the library that runs it (cuDNN, part of the GPU image) can be
swapped between runs of this script in one device call, which a whole training step cannot afford. It calls
the same JAX function MaxText's `cudnn_flash_jax` path calls (`fused_attention_stablehlo.dot_product_attention`,
causal mask, BTNH layout), so the kernels timed are the ones the training step runs. `--implementation einsum`
times attention written out for XLA (einsum, mask, softmax; any backend, the tests run it on the CPU).
The candidates for a faster kernel: `tokamax_mosaic` and `tokamax_triton` (tokamax's Mosaic GPU kernels,
sm90 forward and backward, and its Triton ones; both take the value head dim apart from the query's) and
`te` (TE's cuDNN fused attention with separate Q, K and V, BSHD; the run records whether TE's own check
accepts the shape, and which backend), and `fa3` (FlashAttention-3 built for MLA's widths by
scripts/device/build_fa3_carry.sh, what `attention.kernel: fa3` runs).

FLOPs by the planner's convention (`maxtext_moe.plan.flops`): forward 2 x B x S^2 / 2 x H x (d_qk + d_v), the
backward twice that; the backward's time is forward+backward minus forward. Before timing, the output and dq
of one sequence's first 16 heads are checked against a float32 reference (all 128 at 8K would need 32 GiB
of float32 logits).

    python benchmarks/bench_attention.py --batch 6 --out attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from bench_moe_layer import rel, time_fn

IMPLEMENTATIONS = ("cudnn", "fa3", "tokamax_mosaic", "tokamax_triton", "te", "einsum")


def attention_fn(implementation: str, scale: float) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    if implementation == "cudnn":
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

        return lambda q, k, v: dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, scale=scale, qkv_layout="BTNH")
    if implementation == "fa3":
        from maxtext_moe.upstream import fa3_attention

        fa3_attention.load()
        return lambda q, k, v: fa3_attention.flash_attention(q, k, v, scale)
    if implementation.startswith("tokamax_"):
        import tokamax

        kernel = implementation.removeprefix("tokamax_")
        return lambda q, k, v: tokamax.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation=kernel
        )
    if implementation == "te":
        from transformer_engine.jax import attention as te

        return lambda q, k, v: te.fused_attn(
            (q, k, v), None, None, None, te.AttnBiasType.NO_BIAS, te.AttnMaskType.CAUSAL_MASK,
            te.QKVLayout.BSHD_BSHD_BSHD, te.AttnSoftmaxType.VANILLA_SOFTMAX, scale, 0.0, True,
        )  # fmt: skip
    return lambda q, k, v: reference(q, k, v, scale)


def te_backend(b: int, s: int, h: int, d_qk: int, d_v: int) -> str:
    """The kernel TE's own check picks for this shape, with its reason when it rejects one
    (`NVTE_F16_arbitrary_seqlen` is cuDNN's flash attention; `NVTE_No_Backend` is TE's unfused fallback)."""
    from transformer_engine.jax import attention as te
    from transformer_engine.jax.cpp_extensions.attention import FusedAttnHelper

    mask = te.AttnMaskType.CAUSAL_MASK
    backend, why = FusedAttnHelper(
        is_training=True, batch_size=b, q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
        qkv_layout=te.QKVLayout.BSHD_BSHD_BSHD, attn_bias_type=te.AttnBiasType.NO_BIAS, attn_mask_type=mask,
        softmax_type=te.AttnSoftmaxType.VANILLA_SOFTMAX, dropout_probability=0.0, q_num_heads=h, kv_num_heads=h,
        q_max_seqlen=s, kv_max_seqlen=s, head_dim_qk=d_qk, head_dim_v=d_v, window_size=(-1, -1),
        bottom_right_diagonal=mask.is_bottom_right(),
    ).get_fused_attn_backend()  # fmt: skip
    return f"{backend} {why}".strip()


def reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Causal attention written out, in the inputs' dtype: the yardstick (in float32) and `einsum`."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def cudnn_version() -> int | None:
    try:
        from jax._src.lib import cuda_versions
    except ImportError:
        return None
    return cuda_versions.cudnn_get_version() if cuda_versions is not None else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--d-qk", type=int, default=192, help="query/key head dim (MLA: 128 no-RoPE + 64 RoPE)")
    ap.add_argument("--d-v", type=int, default=128)
    ap.add_argument("--implementation", default="cudnn", choices=IMPLEMENTATIONS)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--label", default="", help="a name for this run in the JSON (the library under test, say)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    b, s, h = a.batch, a.seq, a.heads
    scale = a.d_qk**-0.5
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, s, h, a.d_qk), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, s, h, a.d_qk), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, s, h, a.d_v), jnp.bfloat16)
    cot = jax.random.normal(keys[3], (b, s, h, a.d_v), jnp.bfloat16)
    attend = attention_fn(a.implementation, scale)

    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * cot)

    forward = jax.jit(attend)
    backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    one = (q[:1, :, :16], k[:1, :, :16], v[:1, :, :16])
    one_cot = cot[:1, :, :16]
    one32 = tuple(t.astype(jnp.float32) for t in one)
    dq_ref = jax.grad(lambda q: jnp.sum(reference(q, *one32[1:], scale) * one_cot))(one32[0])
    dq = jax.jit(jax.grad(lambda q: jnp.sum(attend(q, *one[1:]).astype(jnp.float32) * one_cot)))(one[0])
    result: dict[str, Any] = {
        "label": a.label,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "cudnn_version": cudnn_version(),
        "config": vars(a),
        "rel_err_out": rel(forward(*one), reference(*one32, scale)),
        "rel_err_dq": rel(dq, dq_ref),
    }
    if a.implementation == "te":
        result["te_backend"] = te_backend(b, s, h, a.d_qk, a.d_v)
    forward_flops = 2.0 * b * s * s / 2 * h * (a.d_qk + a.d_v)
    fwd = time_fn(lambda: forward(q, k, v), a.warmup, a.iters)
    both = time_fn(lambda: backward(q, k, v), a.warmup, a.iters)
    bwd_ms = both["median_ms"] - fwd["median_ms"]
    result.update(
        forward=fwd,
        forward_backward=both,
        backward_ms=bwd_ms,
        forward_tflops=forward_flops / (fwd["median_ms"] * 1e-3) / 1e12,
        backward_tflops=2 * forward_flops / (bwd_ms * 1e-3) / 1e12,
    )
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{a.label or a.implementation}: cuDNN {result['cudnn_version']}, forward {fwd['median_ms']:.2f} ms "
        f"({result['forward_tflops']:.0f} TFLOP/s), backward {bwd_ms:.2f} ms ({result['backward_tflops']:.0f} "
        f"TFLOP/s), rel err out {result['rel_err_out']:.1e} dq {result['rel_err_dq']:.1e}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
