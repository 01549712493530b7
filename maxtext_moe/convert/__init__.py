"""`maxtext-moe convert`: Hugging Face DeepSeek-V3 checkpoints <-> the Orbax layout MaxText trains from.

MaxText's `checkpoint_conversion` owns the parameter-name mapping and the transposes (its DeepSeek mapping
and hooks, used here as they are). What it leaves out, and these modules fill:

- `safetensors_io`: tensors read one at a time from disk (not from a loaded model), FP8 and BF16 included.
- `fp8`: DeepSeek's FP8 e4m3 weights with 128x128 `weight_scale_inv` blocks, dequantized per tensor.
- `layout`: the MTP layer and the router's `e_score_correction_bias` (MaxText's mapping has neither where
  our recipes keep them), the order in which each MaxText array's slices arrive, the MTP layer's Hugging Face
  shapes, and where a training run's checkpoint keeps the bias.
- `hf_config`: the checkpoint's `config.json` against the recipe, before anything is written.
- `staging`: `OUT.partial`, renamed to `OUT` when complete; an existing `OUT` is refused.
- `to_orbax`: Hugging Face -> Orbax, one tensor at a time, with progress and a temp name renamed when complete.
- `to_hf`: Orbax (a run's checkpoint or a converted folder) -> Hugging Face BF16 safetensors, one tensor at a time.
"""
