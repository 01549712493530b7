"""`moe.attention_residuals: save`: the remat policy keeps flash attention's forward outputs, so the backward
pass does not run the forward kernel again (CPU: JAX's remat machinery on a stand-in primitive and MaxText's
own policy; GPU: cuDNN's kernels counted in the compiled step)."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import name_p
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive, jaxprs_in_params
from jax.interpreters import mlir

from maxtext_moe.upstream import remat

ON_GPU = jax.devices()[0].platform == "gpu"

# A stand-in for JAX's cuDNN forward primitive: the same name, two outputs (the output and statistics).
_fwd_p = Primitive("dot_product_attention_fwd_wrapper")
_fwd_p.multiple_results = True
_fwd_p.def_impl(lambda q: (jnp.sin(q) @ q.T, jnp.cos(q).sum(-1)))
_fwd_p.def_abstract_eval(
    lambda q: (jax.core.ShapedArray((q.shape[0],) * 2, q.dtype), jax.core.ShapedArray(q.shape[:1], q.dtype))
)
mlir.register_lowering(_fwd_p, mlir.lower_fun(lambda q: (jnp.sin(q) @ q.T, jnp.cos(q).sum(-1)), multiple_results=True))


@jax.custom_vjp
def _attention(q: jax.Array) -> tuple[jax.Array, jax.Array]:
    return tuple(_fwd_p.bind(q))


def _attention_fwd(q: jax.Array):
    out, stats = _fwd_p.bind(q)
    return (out, stats), (q, out, stats)  # as JAX's rule: the residuals are the kernel's own outputs


def _attention_bwd(res, g):
    q, out, stats = res
    return (g[0] @ q + out @ q * stats[:, None] + g[1][:, None] * q,)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _layer(q: jax.Array) -> jax.Array:
    out, stats = _attention(q)  # MaxText names both "context" (attention_op.py, cudnn_flash_jax)
    out, stats = checkpoint_name(out, "context"), checkpoint_name(stats, "context")
    return jnp.sum(jnp.tanh(out @ q)) + jnp.sum(stats)


def _count(jaxpr, name: str) -> int:
    n = 0
    for eqn in jaxpr.eqns:
        n += eqn.primitive.name == name
        for sub in jaxprs_in_params(eqn.params):
            n += _count(sub, name)
    return n


def _names_policy():
    return jax.checkpoint_policies.save_only_these_names("context")


@pytest.mark.parametrize("keep", [False, True])
def test_policy_decides_whether_the_backward_reruns_the_attention_forward(keep: bool) -> None:
    policy = remat.keep_attention_residuals(_names_policy()) if keep else _names_policy()
    q = jax.random.normal(jax.random.key(0), (8, 8))
    grad = jax.grad(jax.checkpoint(_layer, policy=policy))
    calls = _count(jax.make_jaxpr(grad)(q).jaxpr, _fwd_p.name)
    # Saving only the named copies still reruns the kernel: its residuals are its own outputs.
    assert calls == (1 if keep else 2)
    np.testing.assert_allclose(grad(q), jax.grad(_layer)(q), rtol=1e-6)


def test_install_wraps_maxtexts_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """After `install`, MaxText's decoder returns its own policy's decisions plus the attention outputs."""
    from maxtext.layers.nnx_decoders import NNXDecoder

    monkeypatch.setattr(NNXDecoder, "get_remat_policy", NNXDecoder.get_remat_policy)
    remat.install()
    remat.install()  # once only: a second call does not wrap twice
    assert NNXDecoder.get_remat_policy.keeps_attention_residuals
    for name, saved in (("minimal", {"mlpwo"}), ("full", set())):
        decoder = types.SimpleNamespace(config=types.SimpleNamespace(remat_policy=name))
        decoder.minimal_policy = functools.partial(NNXDecoder.minimal_policy, decoder)
        policy = NNXDecoder.get_remat_policy(decoder)
        assert {n for n in ("mlpwo", "context") if policy(name_p, name=n)} == saved
        assert policy(_fwd_p) is True


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_cudnn_attention_forward_runs_once_per_step_when_kept() -> None:
    """cuDNN flash attention (JAX's binding, as `attention: cudnn_flash_jax`) under MaxText-style names: the
    compiled gradient holds two forward kernels with the names policy and one with ours; same gradients."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    ks = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (2, 512, 4, 64), jnp.bfloat16) for key in ks)

    def layer(q, k, v):
        out, stats = dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, return_residual=True)
        out, stats = checkpoint_name(out, "context"), checkpoint_name(stats, "context")
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(stats)

    def compiled(policy):
        grad = jax.jit(jax.grad(jax.checkpoint(layer, policy=policy), (0, 1, 2)))
        text = grad.lower(q, k, v).compile().as_text()
        forward = sum(line.count('custom_call_target="__cudnn$fmhaSoftmax"') for line in text.splitlines())
        return forward, grad(q, k, v)

    (names, g_names), (kept, g_kept) = (
        compiled(_names_policy()),
        compiled(remat.keep_attention_residuals(_names_policy())),
    )
    assert (names, kept) == (2, 1)
    for a, b in zip(g_names, g_kept, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
