"""`attention.residuals: save`: the remat policy keeps flash attention's forward outputs, so the backward
pass does not run the forward kernel again (CPU: JAX's remat machinery on a stand-in primitive and MaxText's
own policy; the GPU test, cuDNN's kernels counted in the compiled step, is tests/gpu/test_remat_gpu.py)."""

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

from maxtext_moe.moe.gemm import FP8_OPERANDS
from maxtext_moe.upstream import remat

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
    """After `install`, MaxText's decoder returns its own policy's decisions plus the attention outputs (when
    asked) and, where it saves the wo GEMM's output, our FP8 expert operands; a second call replaces the first
    instead of wrapping it again."""
    from maxtext.layers.nnx_decoders import NNXDecoder

    monkeypatch.setattr(NNXDecoder, "get_remat_policy", NNXDecoder.get_remat_policy)
    names = ("mlpwo", "context", FP8_OPERANDS)
    for attention, policy_name, saved in (
        (True, "minimal", {"mlpwo", FP8_OPERANDS}),
        (True, "full", set()),
        (False, "minimal", {"mlpwo", FP8_OPERANDS}),
    ):
        remat.install(attention_residuals=attention)
        decoder = types.SimpleNamespace(config=types.SimpleNamespace(remat_policy=policy_name))
        decoder.minimal_policy = functools.partial(NNXDecoder.minimal_policy, decoder)
        policy = NNXDecoder.get_remat_policy(decoder)
        assert {n for n in names if policy is not None and policy(name_p, name=n)} == saved
        assert (policy is not None and policy(_fwd_p) is True) == attention


def test_fp8_operands_are_kept_only_where_the_wo_output_would_be() -> None:
    """Only a policy that saves the wo output keeps the FP8 operands in its place: full remat, and policies that
    keep the up-projections alone or offload the wo output, recompute them."""
    minimal = remat.keep_expert_fp8_operands(jax.checkpoint_policies.save_only_these_names("moe_mlpwo"))
    assert minimal(name_p, name=FP8_OPERANDS) is True and minimal(name_p, name="moe_mlpwo") is True
    assert remat.keep_expert_fp8_operands(None) is None
    up_only = jax.checkpoint_policies.save_only_these_names("moe_mlpwi_0", "moe_mlpwi_1")
    assert remat.keep_expert_fp8_operands(up_only) is up_only
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["moe_mlpwo"],
        offload_src="device",
        offload_dst="pinned_host",
    )
    assert remat.keep_expert_fp8_operands(offload) is offload
