"""Model FLOPs per token, in the Megatron/MaxText convention.

6 x the matmul weights a token meets (router, MLA projections, dense FFNs, shared and top-k routed
experts, LM head; not the embedding lookup) + causal attention 6 x L x heads x (d_qk + d_v) x S / 2.
An MTP layer costs attention + MoE FFN of one more layer, its 2E->E projection and a second pass
through the LM head. MaxText (`calculate_tflops_training_per_device`, which it computes only inside a
running trainer) leaves out the last two; `total` counts them (DeepSeek-V3 at 4K: ~260 GFLOP/token
with one MTP layer, as published), `maxtext` does not, so both published and logged figures can be
reproduced.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxtext_moe.plan.model import Model


@dataclass(frozen=True)
class Flops:
    """FLOPs per token of one training step (forward + backward), by part."""

    attention_proj: float  # MLA projections, all decoder layers
    attention_core: float  # QK^T and PV, causal
    dense_ffn: float
    router: float
    shared_experts: float
    routed_experts: float
    head: float
    mtp: float  # MaxText's MTP term (attention + MoE FFN of each MTP layer)
    mtp_routed: float  # the routed-expert part of `mtp`
    mtp_core: float  # the attention-core part of `mtp`
    mtp_uncounted: float  # MTP projection + MTP LM-head pass, not in MaxText's count

    @property
    def maxtext(self) -> float:
        """Per token as MaxText logs it (MTP without its projection and LM-head pass)."""
        return (
            self.attention_proj
            + self.attention_core
            + self.dense_ffn
            + self.router
            + self.shared_experts
            + self.routed_experts
            + self.head
            + self.mtp
        )

    @property
    def total(self) -> float:
        """Per token, everything the step computes (MTP's projection and LM-head pass included)."""
        return self.maxtext + self.mtp_uncounted

    @property
    def without_mtp(self) -> float:
        return self.maxtext - self.mtp

    @property
    def grouped_gemm(self) -> float:
        """Work in the routed experts' grouped GEMM (what `te_gmm_quantization` reaches)."""
        return self.routed_experts + self.mtp_routed

    @property
    def core(self) -> float:
        """Work in the attention kernel (flash attention; never quantized here)."""
        return self.attention_core + self.mtp_core

    @property
    def gemm(self) -> float:
        """Work in ordinary GEMMs (what `quantization` reaches)."""
        return self.total - self.grouped_gemm - self.core


def attention_core_per_layer(m: Model, seq: int) -> float:
    """Causal attention FLOPs per token per layer, forward + backward (halved for the mask)."""
    return 6 * m.heads * (m.qk_nope + m.qk_rope + m.v_head) * seq / 2


def per_token(m: Model, seq: int) -> Flops:
    moe_ffn = 6 * (m.router_weights + m.shared * m.ffn_weights(m.moe_mlp) + m.topk * m.ffn_weights(m.moe_mlp))
    core = attention_core_per_layer(m, seq)
    return Flops(
        attention_proj=6 * m.layers * m.attention_weights,
        attention_core=m.layers * core,
        dense_ffn=6 * m.dense_layers * m.ffn_weights(m.mlp),
        router=6 * m.moe_layers * m.router_weights,
        shared_experts=6 * m.moe_layers * m.shared * m.ffn_weights(m.moe_mlp),
        routed_experts=6 * m.moe_layers * m.topk * m.ffn_weights(m.moe_mlp),
        head=6 * m.head_weights,
        mtp=m.mtp_layers * (6 * m.attention_weights + core + moe_ffn),
        mtp_routed=6 * m.mtp_layers * m.topk * m.ffn_weights(m.moe_mlp),
        mtp_core=m.mtp_layers * core,
        mtp_uncounted=6 * m.mtp_layers * (m.mtp_proj_weights + m.head_weights),
    )
