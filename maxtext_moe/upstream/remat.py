"""What MaxText's remat policies leave out: flash attention's forward outputs (`attention.residuals: save`), and
our block's FP8 expert operands.

The gaps: MaxText 0.2.5's remat policies are lists of tensor names (`save_only_these_names`). Its cuDNN
attention (`attention: cudnn_flash_jax`) names the output and the softmax statistics "context", but the
backward kernel reads them as the residuals of JAX's custom VJP, which are the forward kernel's own outputs,
not the named copies: with any names policy, even `minimal_with_context`, the backward pass runs the
attention forward kernel again (seen in the jaxpr of a checkpointed custom VJP; JAX 0.11.2). A policy can
also decide by primitive; `keep_attention_residuals` saves the outputs of the flash attention forward
primitives and leaves every other decision to MaxText's policy. Cost: per layer the attention output and its
statistics, about batch x seq x heads x v_head_dim x 2 bytes (1 GiB at batch 8 of the one-H200 proxy).

No MaxText policy names what our FP8 grouped GEMMs keep for their backward pass (the transposed FP8 casts of
the permuted input, the activation and the weights, named `gemm.FP8_OPERANDS`), so a policy that saves the
expert GEMM outputs still permutes and casts every expert input again in the backward pass.
`keep_expert_fp8_operands` saves them wherever the policy names the wo GEMM's output to save, which our block
never keeps (it weights the copies before wo, `moe/layer.py`): about (emb_dim + moe_mlp_dim) bytes per routed
copy in the place of the wo output's 2 x emb_dim.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from jax._src.ad_checkpoint import name_p

from maxtext_moe.moe.gemm import FP8_OPERANDS
from maxtext_moe.moe.remat_names import WO_OUTPUT
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


def keep_expert_fp8_operands(policy: Policy | None) -> Policy | None:
    """`policy`, saving our FP8 expert operands too where it would save the wo GEMM's output (named both
    `mlpwo`, which MaxText's `minimal` saves, and `moe_mlpwo`), which no backward pass of our block reads: the
    operands take its place. Unchanged elsewhere (full remat, offloaded or recomputed outputs)."""
    if policy is None or not any(policy(name_p, name=n) is True for n in WO_OUTPUT):
        return policy

    def saving(prim: Any, *args: Any, **params: Any) -> Any:
        if prim is name_p and params.get("name") == FP8_OPERANDS:
            return True
        return policy(prim, *args, **params)

    return saving


def install(attention_residuals: bool) -> None:
    """Make every remat policy MaxText's NNX decoder builds from now on in this process keep our FP8 expert
    operands where it would keep the wo GEMM's output, and flash attention's forward outputs when
    `attention_residuals` (what `get_remat_policy` returns is what its layers checkpoint with). A later call
    replaces the earlier one's choice."""
    from maxtext.layers.nnx_decoders import NNXDecoder

    original = getattr(NNXDecoder.get_remat_policy, "__wrapped__", NNXDecoder.get_remat_policy)

    @functools.wraps(original)
    def get_remat_policy(self: Any) -> Policy | None:
        policy = keep_expert_fp8_operands(original(self))
        return keep_attention_residuals(policy) if attention_residuals else policy

    NNXDecoder.get_remat_policy = get_remat_policy
    log.info(
        "remat: FP8 expert operands kept in the wo output's place; attention outputs kept: %s", attention_residuals
    )
