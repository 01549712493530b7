"""Every place maxtext-moe reaches into MaxText, Transformer Engine or JAX below their public API.

Each module names the gap it fills. `SYMBOLS` lists what they touch, so that one test
(tests/unit/test_upstream.py) checks each still exists in the pinned versions before anything else breaks:

- `deepseek_layer`: rebinds `maxtext.models.deepseek.DeepSeekMoELayer` to run our routed experts, reads
  `RoutedMoE`'s mesh helpers and loss functions, and sows a sequence-wise balance loss as `moe_lb_loss`, which
  `train.loss_fn` adds to the loss (summed over layers under `uses_megatron_seq_aux_loss`).
- `balance_metrics`: per-layer MoE load balance in the step metrics: wraps `train.train_step`, rebinds
  `train.record_activation_metrics`, and for MaxText's own block rebinds `DeepSeekMoELayer` to a subclass
  that re-runs its gate and `RoutedMoE.get_topk`.
- `maxtext_block`: MaxText's own `RoutedAndSharedMoE` on our parameters (the yardstick in tests, benchmarks).
- `skip_nonfinite`: wraps the transform `optimizers.skip_step_on_spikes` builds, so that a non-finite step is
  skipped without entering its window.
- `step_hook`: wraps `train.training_loop_iteration`, the per-step call of MaxText's loop in every process, for
  the heartbeat the hang watchdog reads.
- `stop_metrics`: holds the `StopTraining` that `checkpointing.maybe_save_checkpoint` raises on a SIGTERM until
  `MetricLogger.buffer_and_write_metrics` has the stopped step's metrics.
- `remat`: wraps `NNXDecoder.get_remat_policy` to keep flash attention's forward outputs.
- `remat_cse`: rebinds `maxtext_utils.should_prevent_cse_in_remat`, so that unrolled layers keep their remat
  barrier under gradient accumulation on GPUs (without it XLA merges each recomputation with its forward).
- `mtp_quant`: rebinds `models.MultiTokenPredictionBlock`, and `multi_token_prediction.DenseGeneral` while the block
  is built, so that the MTP layer takes the decoder's quantization.
- `bf16_projections`: rebinds `quantizations.TransformerEngineQuantization.dot_general_cls` and calls its `_wrap`,
  so that the MLA projections `attention.bf16_projections` names compute in BF16 under TE's FP8 recipes.
- `placeholder_constants`: registers the GPU lowering of `lax.empty_p` (JAX's own `_empty_lower`, constant zeros, for
  small arrays; its `_empty_custom_call_lower` for the rest), so that XLA merges TE's FP8 casts of one tensor.
- `maxtext_config`: `pyconfig._initialize_pydantic`, MaxText's config model without its `sys.exit`.
- `maxtext_errors`: unwraps the error `max_utils.transformer_engine_context` turns into a re-yield.
- `te`: TE's `_v2_grouped_gemm_available` flag (grouped-GEMM path) and its JAX bindings.
- `te_group_scales`: wraps TE's `grouped_quantize`: current scaling cast by XLA into TE's grouped FP8 layout
  (`ScaledTensorFactory`, `compute_scale_from_amax`), or for the largest tensors with per-group scales found
  without its scatters, handed to TE through its delayed-scaling quantizers (`DelayedScaleQuantizer`,
  `GroupedQuantizer`).
- `aot`: `train_compile.get_shaped_inputs` and `jit_and_compile`, the step and its shardings, and MaxText's
  `create_device_mesh`, to compile the training step for devices that are not here (JAX's mock GPU topology).
- `maxtext_params`: `models.transformer_as_linen` and `maxtext_utils.get_abstract_param`, the parameter tree
  (names, shapes, dtypes) the conversion writes, keyed as MaxText's converters key it.
- `orbax_stream`: `NumpyHandler._open_and_write`, overridden to write an array slice by slice, and Orbax's
  read spec and tensorstore context (`get_json_tspec_read`, `ParamInfo`, `get_ts_context`) to read one back
  slice by slice.
- `nccl_ep_bootstrap`: wraps `max_utils.maybe_bootstrap_te_moe` (called by `train_utils.setup_train_loop`) to
  bootstrap NCCL EP for our block with `moe.exchange: nccl_ep`.
- `jax_coordination`: `jax._src.distributed.global_state.client`, the key-value store of a multi-process run.
- `training_schedule`: the recipe's `training:` schedules in the step: rebinds
  `maxtext_utils.create_learning_rate_schedule` (a multi-phase learning rate), wraps `train.train_step` (the batch
  ramp as a loss mask, the step's schedule values in its metrics), and rebinds `moe.load_balance_updates_from_counts`
  (also as `gradient_accumulation` imports it) and `train.calculate_mtp_loss` (bias-update rate and MTP weight by step).
- `opaque_vjp`: a JAX primitive of our own around TE's grouped GEMM, declared in
  `jax._src.dispatch.prim_requires_devices_during_lowering` (it lowers TE's custom-partitioned calls).
- `deviceless`: answers the trace-time GPU queries of JAX's cuDNN attention (`check_compute_capability`,
  `is_cuda_compute_capability_equal`) and TE (`get_device_compute_capability`), and drops `jax.debug.callback`,
  to compile for GPUs on a machine without one (`jax.experimental.topologies.get_topology_desc`).
"""

from __future__ import annotations

# (distribution, module, attribute path): what the modules above read or replace.
SYMBOLS: tuple[tuple[str, str, str], ...] = (
    ("maxtext", "maxtext.models.deepseek", "DeepSeekMoELayer.mlp_op"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE.get_topk"),
    ("maxtext", "maxtext.layers.moe", "GateLogit.__call__"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE.get_expert_parallelism_size"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE.get_ragged_buffer_factor"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE._logical_to_mesh_axes"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE.load_balance_loss"),
    ("maxtext", "maxtext.layers.moe", "RoutedMoE.megatron_seq_aux_loss"),
    ("maxtext", "maxtext.layers.moe", "RoutedAndSharedMoE"),
    ("maxtext", "maxtext.layers.moe", "uses_megatron_seq_aux_loss"),
    ("maxtext", "maxtext.trainers.pre_train.train", "loss_fn"),
    ("maxtext", "maxtext.layers.moe", "load_balance_updates_from_counts"),
    ("maxtext", "maxtext.layers.nnx_decoders", "NNXDecoder.get_remat_policy"),
    ("maxtext", "maxtext.utils.maxtext_utils", "should_prevent_cse_in_remat"),
    ("maxtext", "maxtext.optimizers.optimizers", "skip_step_on_spikes"),
    ("maxtext", "maxtext.common.checkpointing", "maybe_save_checkpoint"),
    ("maxtext", "maxtext.common.metric_logger", "MetricLogger.buffer_and_write_metrics"),
    ("maxtext", "maxtext.utils.exceptions", "StopTraining"),
    ("maxtext", "maxtext.models.models", "MultiTokenPredictionBlock"),
    ("maxtext", "maxtext.layers.multi_token_prediction", "DenseGeneral"),
    ("maxtext", "maxtext.layers.quantizations", "TransformerEngineQuantization.dot_general_cls"),
    ("maxtext", "maxtext.layers.quantizations", "TransformerEngineQuantization._wrap"),
    ("maxtext", "maxtext.configs.pyconfig", "_initialize_pydantic"),
    ("maxtext", "maxtext.utils.max_utils", "transformer_engine_context"),
    ("maxtext", "maxtext.utils.max_utils", "maybe_bootstrap_te_moe"),
    ("maxtext", "maxtext.utils.train_utils", "setup_train_loop"),
    ("maxtext", "maxtext.trainers.pre_train.train", "main"),
    ("maxtext", "maxtext.trainers.pre_train.train", "train_step"),
    ("maxtext", "maxtext.trainers.pre_train.train", "record_activation_metrics"),
    ("maxtext", "maxtext.trainers.pre_train.train", "training_loop_iteration"),
    ("maxtext", "maxtext.trainers.pre_train.train_compile", "get_shaped_inputs"),
    ("maxtext", "maxtext.trainers.pre_train.train_compile", "jit_and_compile"),
    ("maxtext", "maxtext.utils.max_utils", "maybe_get_transformer_engine_context"),
    ("maxtext", "maxtext.utils.maxtext_utils", "create_device_mesh"),
    ("maxtext", "maxtext.utils.maxtext_utils", "get_functional_train_with_signature"),
    ("maxtext", "maxtext.utils.sharding", "maybe_update_params_sharding_with_opt"),
    ("maxtext", "maxtext.utils.sharding", "build_zero1_input_state_mesh_shardings"),
    ("maxtext", "maxtext.utils.sharding", "get_input_data_sharding"),
    ("maxtext", "maxtext.models.models", "transformer_as_linen"),
    ("maxtext", "maxtext.utils.maxtext_utils", "get_abstract_param"),
    ("maxtext", "maxtext.utils.maxtext_utils", "create_learning_rate_schedule"),
    ("maxtext", "maxtext.utils.gradient_accumulation", "load_balance_updates_from_counts"),
    ("maxtext", "maxtext.trainers.pre_train.train", "calculate_mtp_loss"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.utils", "param_key_parts_from_path"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.param_mapping", "DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.param_mapping", "DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.tensor_handling", "apply_hook_fns"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.tensor_handling", "stacked_axes"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.tensor_handling", "nesting_depth"),
    ("maxtext", "maxtext.checkpoint_conversion.utils.hf_model_configs", "deepseek3_671b_dict"),
    ("jax", "jax._src.dispatch", "prim_requires_devices_during_lowering"),
    ("jax", "jax._src.lax.lax", "empty_p"),
    ("jax", "jax._src.lax.lax", "_empty_lower"),
    ("jax", "jax._src.lax.lax", "_empty_custom_call_lower"),
    ("orbax-checkpoint", "orbax.checkpoint.type_handlers", "NumpyHandler._open_and_write"),
    ("orbax-checkpoint", "orbax.checkpoint.type_handlers", "get_json_tspec_read"),
    ("orbax-checkpoint", "orbax.checkpoint.type_handlers", "get_ts_context"),
    ("orbax-checkpoint", "orbax.checkpoint.type_handlers", "is_ocdbt_checkpoint"),
    ("orbax-checkpoint", "orbax.checkpoint.type_handlers", "ParamInfo"),
    ("jax", "jax._src.distributed", "global_state.client"),
    ("jax", "jax._src.xla_bridge", "MOCK_GPU_TOPOLOGY"),
    ("jax", "jax._src.cudnn.fused_attention_stablehlo", "check_compute_capability"),
    ("jax", "jax._src.cudnn.fused_attention_stablehlo", "is_cuda_compute_capability_equal"),
    ("jax", "jax.experimental.topologies", "get_topology_desc"),
    ("transformer-engine-jax", "transformer_engine.jax.cpp_extensions.gemm", "_v2_grouped_gemm_available"),
    ("transformer-engine-jax", "transformer_engine.jax.dense", "grouped_dense"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize", "QuantizerFactory.create_set"),
    ("transformer-engine-jax", "transformer_engine.jax.cpp_extensions", "grouped_quantize"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize", "DelayedScaleQuantizer"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize", "GroupedQuantizer"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize", "compute_scale_from_amax"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize", "ScaledTensorFactory.create"),
    ("transformer-engine-jax", "transformer_engine.jax.quantize.device_utils", "get_device_compute_capability"),
)
