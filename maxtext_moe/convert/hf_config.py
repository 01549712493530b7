"""The Hugging Face `config.json` that matches a recipe's model, and a checkpoint's config checked against it.

MaxText's `hf_model_configs.deepseek3_671b_dict` is DeepSeek-V3's published config; the recipe's widths,
counts and RoPE settings replace its values (MaxText's converters take a fixed model and do not check the
checkpoint against it). A mismatch names the key on each side before anything is written.
"""

from __future__ import annotations

from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe

# Hugging Face key -> MaxText key: what fixes a parameter's shape, so must agree.
SHAPE_KEYS = {
    "hidden_size": "base_emb_dim",
    "intermediate_size": "base_mlp_dim",
    "moe_intermediate_size": "base_moe_mlp_dim",
    "num_hidden_layers": "base_num_decoder_layers",
    "first_k_dense_replace": "first_num_dense_layers",
    "n_routed_experts": "num_experts",
    "n_shared_experts": "shared_experts",
    "num_attention_heads": "base_num_query_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "vocab_size": "vocab_size",
}
# Keys that change what the model computes, not its shapes: written to config.json, not checked.
BEHAVIOUR_KEYS = {
    "num_key_value_heads": "base_num_kv_heads",
    "num_experts_per_tok": "num_experts_per_tok",
    "routed_scaling_factor": "routed_scaling_factor",
    "rms_norm_eps": "normalization_layer_epsilon",
    "rope_theta": "rope_max_timescale",
    "max_position_embeddings": "max_position_embeddings",
}


def for_recipe(r: ResolvedRecipe) -> dict[str, Any]:
    """DeepSeek-V3's config.json with the recipe's model in it (what `transformers` builds the same model from)."""
    from maxtext.checkpoint_conversion.utils.hf_model_configs import deepseek3_671b_dict

    e = r.effective
    config = {k: v for k, v in deepseek3_671b_dict.items() if k not in ("auto_map", "transformers_version")}
    config |= {hf: e(mt) for hf, mt in (SHAPE_KEYS | BEHAVIOUR_KEYS).items()}
    groups = int(e("n_routing_groups"))
    config |= {
        "n_group": max(groups, 1),
        "topk_group": int(e("topk_routing_group")) if groups > 0 else 1,
        "num_nextn_predict_layers": int(e("mtp_num_layers")),
        "torch_dtype": "bfloat16",
        "rope_scaling": dict(
            config["rope_scaling"],
            factor=float(e("rope_factor")),
            original_max_position_embeddings=int(e("original_max_position_embeddings")),
            beta_fast=float(e("beta_fast")),
            beta_slow=float(e("beta_slow")),
            mscale=float(e("mscale")),
            rope_theta=e("rope_max_timescale"),
        ),
    }
    return config


def check(checkpoint: dict[str, Any], r: ResolvedRecipe, where: str) -> None:
    """Refuse a checkpoint whose shapes differ from the recipe's model: one line naming both keys."""
    for hf, mt in SHAPE_KEYS.items():
        if hf not in checkpoint:
            raise UserError(f"{where}: no {hf!r}; not a DeepSeek-V3 config.", fix="pass a DeepSeek-V3 checkpoint.")
        if int(checkpoint[hf]) != int(r.effective(mt)):
            source = r.sources.get(f"maxtext.{mt}", f"model {r.effective('model_name')}")
            raise UserError(
                f"{where}: {hf} is {checkpoint[hf]}, but the recipe's {mt} is {r.effective(mt)} ({source}).",
                fix=f"pick the recipe of this checkpoint's model, or override {mt}={checkpoint[hf]}.",
            )
    want, have = int(r.effective("mtp_num_layers")), int(checkpoint.get("num_nextn_predict_layers", 0))
    if want > have:
        raise UserError(
            f"{where}: num_nextn_predict_layers is {have}, but the recipe's mtp_num_layers is {want}.",
            fix=f"override mtp_num_layers={have}.",
        )
