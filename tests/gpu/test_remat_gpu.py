"""`attention.residuals: save` on a GPU: cuDNN flash attention's forward kernel runs once per step when its
outputs are kept, twice under a names-only remat policy, with the same gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name

from maxtext_moe.upstream import remat

ON_GPU = jax.devices()[0].platform == "gpu"


def _names_policy():
    return jax.checkpoint_policies.save_only_these_names("context")


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
