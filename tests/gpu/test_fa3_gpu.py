"""FlashAttention-3 at MLA's head widths (`attention.kernel: fa3`) against the float32 reference, and kept
whole by `attention.residuals: save`.

Needs FA3's library (scripts/device/build_fa3_carry.sh, unpacked on PYTHONPATH; scripts/device/common.sh does
that on the H200). The kernel tests need an H100/H200; the remat test compiles without a GPU through JAX's
CUDA plugin, as the deviceless plan tests do.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from conftest import rel
from jax.ad_checkpoint import checkpoint_name

from maxtext_moe.errors import UserError
from maxtext_moe.upstream import fa3_attention, remat

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        importlib.util.find_spec(fa3_attention.LIBRARY.split(".")[0]) is None,
        reason=f"needs FA3's library ({fa3_attention.BUILD})",
    ),
]
ON_HOPPER = jax.devices()[0].platform == "gpu" and jax.devices()[0].compute_capability.startswith("9")
TOL = 2e-2  # relative L2 error of BF16 attention against float32


def _inputs(b: int, s: int, h: int) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, s, h, 192), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, h, 192), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, h, 128), jnp.bfloat16)
    cot = jax.random.normal(ks[3], (b, s, h, 128), jnp.float32)
    return q, k, v, cot


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = q.shape[1]
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)


@pytest.mark.skipif(not ON_HOPPER, reason="needs an H100 or H200 (FA3 is built for sm_90a)")
@pytest.mark.parametrize("seq", [512, 320])  # 320: a last block of 64 rows, and statistics padded to 384
def test_fa3_matches_float32_reference_forward_and_gradients(seq: int) -> None:
    fa3_attention.load()
    q, k, v, cot = _inputs(2, seq, 4)
    scale = 192**-0.5

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)

    fa3 = lambda q, k, v: fa3_attention.flash_attention(q, k, v, scale)  # noqa: E731
    ref = lambda q, k, v: _reference(q, k, v, scale)  # noqa: E731
    f32 = tuple(t.astype(jnp.float32) for t in (q, k, v))
    assert rel(jax.jit(fa3)(q, k, v), ref(*f32)) < TOL
    grads = jax.jit(jax.grad(lambda *a: loss(fa3, *a), (0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: loss(ref, *a), (0, 1, 2))(*f32)
    for name, got, exp in zip("qkv", grads, want, strict=True):
        assert got.shape == exp.shape
        assert rel(got, exp) < TOL, name


def test_fa3_forward_runs_once_per_step_when_kept() -> None:
    """Under MaxText-style names only, the backward runs FA3's forward again; with `attention.residuals: save`
    the compiled gradient holds one forward kernel and one backward."""
    fa3_attention.load()
    q, k, v, _ = _inputs(1, 256, 2)

    def layer(q, k, v):
        out = checkpoint_name(fa3_attention.flash_attention(q, k, v, 0.1), "context")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    def kernels(policy) -> tuple[int, int]:
        text = jax.jit(jax.grad(jax.checkpoint(layer, policy=policy), (0, 1, 2))).lower(q, k, v).as_text()
        return text.count("@" + fa3_attention.FORWARD_TARGET), text.count("@" + fa3_attention.BACKWARD_TARGET)

    names = jax.checkpoint_policies.save_only_these_names("context")
    assert kernels(names) == (2, 1)
    assert kernels(remat.keep_attention_residuals(names)) == (1, 1)


def test_fa3_refuses_what_it_was_not_built_for() -> None:
    q, k, v, _ = _inputs(1, 128, 2)
    fa3_attention.check_shapes(q, k, v)
    with pytest.raises(UserError, match="192, 128"):
        fa3_attention.check_shapes(q[..., :128], k[..., :128], v)
    with pytest.raises(UserError, match="BF16"):
        fa3_attention.check_shapes(q.astype(jnp.float16), k, v)
