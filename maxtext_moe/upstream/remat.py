"""Keep flash attention's forward outputs through MaxText's remat policy (`attention.residuals: save`).

The gap: MaxText 0.2.5's remat policies are lists of tensor names (`save_only_these_names`). Its cuDNN
attention (`attention: cudnn_flash_jax`) names the output and the softmax statistics "context", but the
backward kernel reads them as the residuals of JAX's custom VJP, which are the forward kernel's own outputs,
not the named copies: with any names policy, even `minimal_with_context`, the backward pass runs the
attention forward kernel again (seen in the jaxpr of a checkpointed custom VJP; JAX 0.11.2). A policy can
also decide by primitive; this one saves the outputs of the flash attention forward primitives and leaves
every other decision to MaxText's policy. Cost: per layer the attention output and its statistics, about
batch x seq x heads x v_head_dim x 2 bytes (1 GiB at batch 8 of the one-H200 proxy).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from maxtext_moe.upstream import fa3_attention

log = logging.getLogger(__name__)

# The outer primitives the attention forward binds while tracing: JAX's cuDNN binding
# (jax._src.cudnn.fused_attention_stablehlo) and TE's fused attention (attention: cudnn_flash_te); FA3's
# (attention.kernel: fa3) is a generic FFI call, told apart by its target (`fa3_attention.is_forward`).
ATTENTION_FORWARD_PRIMITIVES = frozenset({"dot_product_attention_fwd_wrapper", "te_fused_attn_forward_ffi_wrapper"})

Policy = Callable[..., Any]


def keep_attention_residuals(policy: Policy | None) -> Policy:
    """`policy` (None: save nothing, MaxText's full remat) that also saves flash attention's forward outputs."""

    def saving(prim: Any, *args: Any, **params: Any) -> Any:
        if prim.name in ATTENTION_FORWARD_PRIMITIVES or fa3_attention.is_forward(prim, params):
            return True
        return policy(prim, *args, **params) if policy is not None else False

    return saving


def install() -> None:
    """Make every remat policy MaxText's NNX decoder builds from now on in this process keep attention's
    forward outputs (what `get_remat_policy` returns is what its layers checkpoint with)."""
    from maxtext.layers.nnx_decoders import NNXDecoder

    original = NNXDecoder.get_remat_policy
    if getattr(original, "keeps_attention_residuals", False):
        return

    @functools.wraps(original)
    def get_remat_policy(self: Any) -> Policy:
        return keep_attention_residuals(original(self))

    get_remat_policy.keeps_attention_residuals = True  # type: ignore[attr-defined]
    NNXDecoder.get_remat_policy = get_remat_policy
    log.info("remat: flash attention's forward outputs are saved for the backward pass")
