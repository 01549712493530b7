"""DeepSeek-style model shapes and parameter counts, read from a resolved recipe.

MaxText counts parameters only by initialising the model under jax; the planner needs them per
component (attention, dense FFN, router, routed and shared experts, embeddings, MTP) and per sharding
class (expert weights shard over the expert axis, the rest over FSDP and expert), without jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe


@dataclass(frozen=True)
class Model:
    """The widths and counts of a MLA + MoE decoder (MaxText's `decoder_block: deepseek`)."""

    emb: int
    heads: int
    q_lora: int  # 0: queries projected directly from the embedding
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    mlp: int  # dense FFN width (first_num_dense_layers)
    moe_mlp: int  # width of one routed or shared expert
    layers: int
    dense_layers: int
    experts: int
    topk: int
    shared: int
    vocab: int
    mtp_layers: int
    n_up: int  # up-projections per FFN (len(mlp_activations): 2 for SwiGLU)

    @classmethod
    def from_recipe(cls, r: ResolvedRecipe) -> Model:
        """Read the shapes MaxText will build; refuse models this planner does not describe."""
        block, attn = r.effective("decoder_block"), r.effective("attention_type")
        if block != "deepseek" or attn != "mla":
            raise UserError(
                f"plan models DeepSeek-style decoders (decoder_block deepseek, attention_type mla); this recipe "
                f"has decoder_block={block!r}, attention_type={attn!r}.",
                key="model_name",
                source=r.sources.get("maxtext.model_name"),
                fix="use a deepseek3-* model_name, or count this model with MaxText's own tools.",
            )
        e = r.effective
        return cls(
            emb=e("base_emb_dim"),
            heads=e("base_num_query_heads"),
            q_lora=e("q_lora_rank"),
            kv_lora=e("kv_lora_rank"),
            qk_nope=e("qk_nope_head_dim"),
            qk_rope=e("qk_rope_head_dim"),
            v_head=e("v_head_dim"),
            mlp=e("base_mlp_dim"),
            moe_mlp=e("base_moe_mlp_dim"),
            layers=e("base_num_decoder_layers"),
            dense_layers=e("first_num_dense_layers"),
            experts=e("num_experts"),
            topk=e("num_experts_per_tok"),
            shared=e("shared_experts"),
            vocab=e("vocab_size"),
            mtp_layers=e("mtp_num_layers"),
            n_up=len(e("mlp_activations")),
        )

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    # --- per-layer matmul weights (what the FLOPs count) ---------------------------------------
    @property
    def q_weights(self) -> int:
        qk = self.heads * (self.qk_nope + self.qk_rope)
        return self.emb * self.q_lora + self.q_lora * qk if self.q_lora else self.emb * qk

    @property
    def kv_weights(self) -> int:
        return self.emb * (self.kv_lora + self.qk_rope) + self.kv_lora * self.heads * (self.qk_nope + self.v_head)

    @property
    def out_weights(self) -> int:
        return self.heads * self.v_head * self.emb

    @property
    def attention_weights(self) -> int:
        return self.q_weights + self.kv_weights + self.out_weights

    def ffn_weights(self, width: int) -> int:
        """One gated FFN of `width`: n_up up-projections and one down-projection."""
        return (self.n_up + 1) * self.emb * width

    @property
    def router_weights(self) -> int:
        return self.emb * self.experts

    @property
    def head_weights(self) -> int:
        return self.emb * self.vocab

    @property
    def mtp_proj_weights(self) -> int:
        """MTP's projection of [embedding; hidden] (2 emb -> emb), per MTP layer."""
        return 2 * self.emb * self.emb

    # --- parameter counts (sharding classes) -----------------------------------------------------
    @property
    def routed_expert_params(self) -> int:
        """All routed-expert weights, MTP layers included: these shard over the expert axis."""
        return (self.moe_layers + self.mtp_layers) * self.experts * self.ffn_weights(self.moe_mlp)

    @property
    def norm_params(self) -> int:
        per_layer = 2 * self.emb + (self.q_lora if self.q_lora else 0) + self.kv_lora
        return (self.layers + self.mtp_layers) * per_layer + self.emb + self.mtp_layers * 3 * self.emb

    @property
    def other_params(self) -> int:
        """Everything but routed experts: attention, dense FFNs, shared experts, router, embeddings, MTP."""
        moe_dense_part = self.ffn_weights(self.moe_mlp) * self.shared + self.router_weights + self.experts  # + bias
        decoder = (
            self.layers * self.attention_weights
            + self.dense_layers * self.ffn_weights(self.mlp)
            + self.moe_layers * moe_dense_part
        )
        mtp = self.mtp_layers * (self.attention_weights + moe_dense_part + self.mtp_proj_weights)
        return decoder + mtp + 2 * self.emb * self.vocab + self.norm_params

    @property
    def total_params(self) -> int:
        return self.routed_expert_params + self.other_params

    @property
    def main_params(self) -> int:
        """Parameters without the MTP layers (the figure model cards quote)."""
        return Model(**{**self.__dict__, "mtp_layers": 0}).total_params

    def layer_weights(self, moe: bool, experts_per_rank: int) -> int:
        """Matmul weights of one decoder layer as one expert-parallel rank holds them once gathered."""
        if not moe:
            return self.attention_weights + self.ffn_weights(self.mlp)
        return (
            self.attention_weights
            + self.router_weights
            + self.shared * self.ffn_weights(self.moe_mlp)
            + experts_per_rank * self.ffn_weights(self.moe_mlp)
        )
