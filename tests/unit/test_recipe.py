"""Recipe composition and every validation error, on real YAML files; no jax needed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition
from maxtext_moe.recipe.validate import resolve
from maxtext_moe.upstream import maxtext_config

TINY = "deepseek3-tiny-cpu"


def compose_resolve(ref, *overrides):
    return resolve(composition.compose(str(ref), list(overrides)))


def error_of(ref, *overrides) -> str:
    with pytest.raises(UserError) as e:
        compose_resolve(ref, *overrides)
    return str(e.value)


# ---- composition -------------------------------------------------------------------------------


def test_default_recipe_composes_fragments_in_order_with_sources():
    r = compose_resolve(TINY)
    assert r.files[0] == "configs/base/maxtext-moe.yml"
    assert r.files[-1] == "recipes/deepseek3-tiny-cpu.yml"
    assert r.maxtext["model_name"] == "deepseek3-tiny"
    assert r.sources["maxtext.model_name"] == "configs/model/deepseek3-tiny.yml"
    assert r.sources["maxtext.steps"] == "recipes/deepseek3-tiny-cpu.yml"
    assert r.maxtext["hardware"] == "cpu" and "derived" in r.sources["maxtext.hardware"]
    assert r.env["JAX_PLATFORMS"] == "cpu"


def test_later_files_and_command_line_override_earlier(recipe_file):
    path = recipe_file(
        "include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device]\n"
        "maxtext: {vocab_size: 1000, steps: 7}\n"
    )
    r = compose_resolve(path, "steps=9", "env.NCCL_DEBUG=INFO", "xla.xla_dump_to=/tmp/x")
    assert r.maxtext["vocab_size"] == 1000 and r.sources["maxtext.vocab_size"] == str(path)
    assert r.maxtext["steps"] == 9 and r.sources["maxtext.steps"] == "command line"
    assert r.env["NCCL_DEBUG"] == "INFO"
    assert r.env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x"


def test_xla_flags_section_is_joined_and_bools_lowercased(recipe_file):
    path = recipe_file(
        "include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device]\n"
        "xla_flags: {xla_gpu_enable_latency_hiding_scheduler: true,"
        " xla_gpu_all_gather_combine_threshold_bytes: 6442450944}\n"
    )
    flags = compose_resolve(path).env["XLA_FLAGS"].split()
    assert flags == [
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_all_gather_combine_threshold_bytes=6442450944",
    ]


def test_resolved_values_reach_maxtext_unchanged():
    """What `show` prints is what MaxText's own config model ends up with."""
    r = compose_resolve(TINY)
    config = maxtext_config.check(r.maxtext, r.sources)
    for key in (
        "steps",
        "learning_rate",
        "n_routing_groups",
        "routed_bias_update_rate",
        "mtp_num_layers",
        "base_num_decoder_layers",
        "vocab_size",
        "sparse_matmul",
        "megablox",
    ):
        assert getattr(config, key) == r.maxtext[key], key
    assert list(config.train_data_columns) == ["text"]


def test_resolver_does_not_import_jax():

    code = (
        "import sys; from maxtext_moe.recipe import composition, validate; "
        f"validate.resolve(composition.compose({TINY!r})); print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# ---- errors: each names the key, the file and the fix -------------------------------------------


def test_unknown_recipe_suggests_the_close_one():
    assert "no recipe named 'deepseek3-tiny-cp'. Did you mean 'deepseek3-tiny-cpu'?" in error_of("deepseek3-tiny-cp")


def test_unknown_maxtext_key_in_file_names_file_and_suggests(recipe_file):
    path = recipe_file("include: [base/maxtext-moe]\nmaxtext: {num_expert: 8}\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: num_expert: unknown MaxText key. Did you mean 'num_experts'?")


def test_unknown_key_on_command_line():
    assert "command line: per_device_batch: unknown MaxText key. Did you mean 'per_device_batch_size'?" in error_of(
        TINY, "per_device_batch=2"
    )


def test_unknown_section_and_fragment(recipe_file):
    assert "unknown section 'maxtxt'. Did you mean 'maxtext'?" in error_of(recipe_file("maxtxt: {steps: 1}\n"))
    msg = error_of(recipe_file("include: [model/deepseek3-tinyy]\n"))
    assert "no fragment 'model/deepseek3-tinyy'. Did you mean 'model/deepseek3-tiny'?" in msg


def test_invalid_yaml_names_file(recipe_file):
    path = recipe_file("maxtext: {steps: [1,\n")
    assert error_of(path).startswith(f"{path}: is not valid YAML")


def test_wrong_type(recipe_file):
    msg = error_of(TINY, "steps=abc")
    assert msg.startswith("command line: steps: must be an integer, got 'abc' (str).")
    path = recipe_file(
        "include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device]\n"
        "maxtext: {sparse_matmul: 'yes'}\n"
    )
    assert f"{path}: sparse_matmul: must be true or false" in error_of(path)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("steps=0", "steps: must be at least 1 (or -1 to follow learning_rate_schedule_steps), got 0."),
        ("per_device_batch_size=-1", "per_device_batch_size: must be greater than 0, got -1."),
        ("learning_rate=0", "learning_rate: must be greater than 0, got 0."),
        ("routed_bias_update_rate=-0.1", "routed_bias_update_rate: must be 0 or more, got -0.1."),
        ("num_experts_per_tok=32", "num_experts_per_tok: routes each token to 32 experts but the model has only 16."),
        ("first_num_dense_layers=9", "first_num_dense_layers: is 9 but the model has only 4 decoder layers."),
    ],
)
def test_out_of_range(override, expected):
    assert f"command line: {expected}" in error_of(TINY, override)


def test_megablox_on_cpu_names_the_default_when_unset(recipe_file):
    path = recipe_file(
        "include: [model/deepseek3-tiny, hardware/cpu, parallelism/single-device]\nmaxtext: {sparse_matmul: true}\n"
    )
    msg = error_of(path)
    assert msg.startswith("MaxText's base.yml default: megablox: is true, but megablox is a TPU kernel")
    assert "Fix: set megablox: false" in msg


def test_fp8_on_hardware_without_fp8():
    msg = error_of(TINY, "quantization=te_fp8_currentscaling")
    assert "command line: quantization: asks for FP8 (te_fp8_currentscaling) but cpu has no FP8 matrix units." in msg


def test_mxfp8_experts_on_hopper_are_refused():
    msg = error_of(TINY, "topology.hardware=h200", "topology.gpus_per_node=1", "te_gmm_quantization=te_mxfp8")
    assert "te_gmm_quantization: is te_mxfp8, but MXFP8 needs Blackwell (SM100) and h200 is SM90." in msg


def test_te_moe_block_refuses_to_drop_the_bias_update():
    msg = error_of(
        TINY,
        "topology.hardware=h200",
        "topology.gpus_per_node=1",
        "te_moe_block=true",
        "te_gmm_quantization=te_no_quant",
    )
    assert msg.startswith("configs/model/deepseek3-tiny.yml: routed_bias_update_rate: is above 0")
    assert "would drop it" in msg


def test_expert_parallel_size_must_divide_experts():
    msg = error_of(TINY, "topology.gpus_per_node=3", "ici_expert_parallelism=3")
    assert "command line: ici_expert_parallelism: is 3, which does not divide num_experts=16." in msg


def test_mesh_must_match_device_count():
    msg = error_of(TINY, "topology.gpus_per_node=4")
    assert "the mesh (all 1) does not fit 4 devices (1 node(s) x 4)" in msg
    msg = error_of(TINY, "topology.gpus_per_node=4", "ici_fsdp_parallelism=2")
    assert msg.startswith(
        "command line: ici_fsdp_parallelism: the mesh (ici_fsdp_parallelism=2) does not fit 4 devices"
    )
    assert compose_resolve(TINY, "topology.gpus_per_node=4", "ici_fsdp_parallelism=-1").topology.num_devices == 4


def test_a_mesh_that_cannot_split_a_weight_is_refused_before_compiling():
    """FSDP128 x EP8 on 1024 GPUs splits DeepSeek-V3's kv_lora_rank (512) 1024 ways: XLA refused it only when
    compiling the step (found by `plan --compile` of the GB300 recipe); the recipe now repeats FSDP16 x EP8."""
    gb300 = "deepseek3-671b-gb300-1024"
    msg = error_of(gb300, "ici_data_parallelism=1")
    assert (
        "ici_fsdp_parallelism: splits the weights' kv_lora dimension (kv_lora_rank=512) fsdp 128 x expert 8 = 1024"
        in msg
    )
    assert "Fix: move a factor to data parallelism" in msg
    assert compose_resolve(gb300).topology.num_devices == 1024
    msg = error_of(TINY, "topology.gpus_per_node=3", "ici_fsdp_parallelism=3")  # the tiny model's kv_lora_rank is 16
    assert "splits the weights' kv_lora dimension (kv_lora_rank=16) fsdp 3 = 3 ways" in msg


def test_dcn_axes_are_refused_on_gpu():
    msg = error_of(TINY, "dcn_fsdp_parallelism=2")
    assert "dcn_fsdp_parallelism: is not 1, but on GPUs and CPUs MaxText sees all devices as one slice." in msg


def test_unknown_hardware_and_bad_topology():
    assert "topology.hardware: unknown hardware 'h20'. Did you mean 'h200'?" in error_of(TINY, "topology.hardware=h20")
    assert "topology.nodes: must be a whole number of at least 1, got 0." in error_of(TINY, "topology.nodes=0")


def test_explicit_maxtext_hardware_must_agree_with_topology():
    assert "hardware: is 'gpu' but topology.hardware is cpu" in error_of(TINY, "hardware=gpu")


def test_override_syntax_errors():
    assert "override 'steps' has no '='" in error_of(TINY, "steps")
    assert "unknown prefix 'evn' in 'evn.X'. Did you mean 'env'?" in error_of(TINY, "evn.X=1")
    assert "xla_flags.gpu_foo: XLA flag names start with 'xla_'" in error_of(TINY, "xla.gpu_foo=1")
    assert "topology.node: unknown topology field. Did you mean 'nodes'?" in error_of(TINY, "topology.node=2")
    assert "corpus.max_mb: unknown corpus field. Did you mean 'max_mib'?" in error_of(TINY, "corpus.max_mb=3")
    assert "env.1X: is not a valid environment variable name." in error_of(TINY, "env.1X=3")


def test_maxtext_pydantic_validation_also_runs():
    """A value our checks pass (a string) that MaxText's own model rejects is reported with its key."""
    r = compose_resolve(TINY, "opt_type=sgdd")
    with pytest.raises(UserError) as e:
        maxtext_config.check(r.maxtext, r.sources)
    assert str(e.value).startswith("command line: opt_type: MaxText rejects it: Input should be")


def test_every_recipe_file_is_a_mapping_with_a_description():
    for name in composition.recipe_names():
        data = yaml.safe_load(composition.find_recipe(name).read_text())
        assert data.get("description"), name


def test_moe_section_defaults_and_checks():
    assert compose_resolve(TINY).moe == {"impl": "maxtext"}
    r = compose_resolve(TINY, "moe.impl=ours")
    assert r.moe == {
        "impl": "ours",
        "gemm": "ragged_dot",
        "te_gemm_path": "auto",
        "fp8": "none",
        "fp8_cast": "te",
        "exchange": "auto",
        "dispatch_chunks": 1,
        "seq_balance_loss_weight": 0.0,
    }
    assert r.attention == {"residuals": "recompute", "kernel": "cudnn", "bf16_projections": []}
    assert r.sources["moe.gemm"] == "default for cpu"
    assert "moe.impl: must be one of maxtext, ours, got 'mine'." in error_of(TINY, "moe.impl=mine")
    assert "moe.gemm: applies only to moe.impl: ours" in error_of(TINY, "moe.gemm=tokamax")
    assert "moe.gemm: is te, but Transformer Engine's grouped GEMM needs an NVIDIA GPU" in error_of(
        TINY, "moe.impl=ours", "moe.gemm=te"
    )
    assert "attention.residuals: is save, but attention is 'dot_product'" in error_of(
        TINY, "attention.residuals=save", "attention=dot_product"
    )
    assert compose_resolve("deepseek3-proxy-h200-1gpu").attention["residuals"] == "save"
    moved = error_of(TINY, "moe.impl=ours", "moe.attention_residuals=save")
    assert "moe.attention_residuals: has moved to attention.residuals." in moved and "\n" not in moved
    ep = ("moe.impl=ours", "topology.gpus_per_node=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=1")
    assert compose_resolve(TINY, *ep).maxtext["ici_expert_parallelism"] == 2
    assert "use_ring_of_experts: is true, but moe.impl: ours does its own expert-parallel dispatch" in error_of(
        TINY, *ep, "use_ring_of_experts=true"
    )
    two = "deepseek3-proxy-h200-2gpu"
    assert compose_resolve(two).maxtext["scan_layers"] is False and compose_resolve(two).moe["exchange"] == "auto"
    assert compose_resolve(two, "scan_layers=true").maxtext["scan_layers"] is True  # compiles: opaque_vjp.py
    assert "moe.exchange: is ragged_all_to_all, which XLA implements on GPUs only" in error_of(
        TINY, *ep, "moe.exchange=ragged_all_to_all"
    )
    assert compose_resolve(two, "moe.exchange=ragged_all_to_all").moe["exchange"] == "ragged_all_to_all"
    assert compose_resolve(two, "moe.dispatch_chunks=2").moe["dispatch_chunks"] == 2
    assert "moe.dispatch_chunks: must be one of 1, 2, 4, got 3." in error_of(two, "moe.dispatch_chunks=3")
    assert "moe.dispatch_chunks: is 2, but this recipe has no expert parallelism" in error_of(
        "deepseek3-proxy-h200-1gpu", "moe.dispatch_chunks=2"
    )
    assert "moe.dispatch_chunks: is 2 with moe.exchange: nccl_ep, but TE's NCCL EP dispatches" in error_of(
        two, "moe.exchange=nccl_ep", "moe.dispatch_chunks=2"
    )
    assert (
        "decoder_block: is 'llama2', but moe.impl: ours replaces the routed experts of MaxText's DeepSeek"
        in error_of(TINY, "moe.impl=ours", "decoder_block=llama2")
    )
    assert compose_resolve("deepseek3-proxy-h200-1gpu", "moe.impl=maxtext").moe == {
        "impl": "maxtext",
        "seq_balance_loss_weight": 0.0001,  # the model's: MaxText's block computes it too
    }
    gpu = compose_resolve(TINY, "moe.impl=ours", "topology.hardware=h200", "topology.gpus_per_node=1")
    assert gpu.moe["gemm"] == "te"


def test_sequence_balance_loss_weight(tmp_path):
    """DeepSeek-V3's alpha: a number >= 0 (text such as 1e-4 read as one), refused beside MaxText's own balance
    loss, and it makes MaxText's step add the layers' losses; MaxText's block runs the model without it."""
    r = compose_resolve(TINY, "moe.impl=ours", "moe.seq_balance_loss_weight=1e-4")
    assert r.moe["seq_balance_loss_weight"] == 0.0001 and r.maxtext["moe_use_megatron_seq_aux_loss"] is True
    assert r.sources["maxtext.moe_use_megatron_seq_aux_loss"] == (
        "derived from moe.seq_balance_loss_weight (command line)"
    )
    off = compose_resolve(TINY, "moe.impl=ours", "moe.seq_balance_loss_weight=0")
    assert off.moe["seq_balance_loss_weight"] == 0.0 and "moe_use_megatron_seq_aux_loss" not in off.maxtext
    for bad in ("-0.1", "abc", "true", ".nan"):
        message = error_of(TINY, "moe.impl=ours", f"moe.seq_balance_loss_weight={bad}")
        assert message.startswith("command line: moe.seq_balance_loss_weight: must be a number >= 0"), message
        assert "Fix: write a weight such as 0.0001" in message and "\n" not in message
    recipe = tmp_path / "bad.yml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "include": ["base/maxtext-moe", "model/deepseek3-tiny", "hardware/cpu", "parallelism/single-device"],
                "moe": {"impl": "ours", "seq_balance_loss_weight": -1},
            }
        )
    )
    message = error_of(recipe)
    assert "bad.yml: moe.seq_balance_loss_weight: must be a number >= 0" in message and "got -1." in message
    both = error_of(TINY, "moe.impl=ours", "moe.seq_balance_loss_weight=0.0001", "load_balance_loss_weight=0.01")
    assert both.startswith(
        "command line: load_balance_loss_weight: is 0.01, and moe.seq_balance_loss_weight is 0.0001 (command line)"
    )
    assert "Fix: keep one" in both and "\n" not in both
    summed = error_of(TINY, "moe.impl=ours", "moe.seq_balance_loss_weight=1e-4", "moe_use_megatron_seq_aux_loss=false")
    assert "moe_use_megatron_seq_aux_loss: is false, but moe.seq_balance_loss_weight is 0.0001" in summed
    # The 671B model fragment pins it; MaxText's block (the FSDP proxy, or moe.impl=maxtext) computes the same
    # loss itself, weighted by its own key; a recipe that sets that key too is refused as above.
    for maxtexts, weight in (
        (compose_resolve("deepseek3-proxy-h200-2gpu-fsdp"), 0.0001),
        (compose_resolve(TINY, "moe.seq_balance_loss_weight=1"), 1.0),
    ):
        assert maxtexts.moe == {"impl": "maxtext", "seq_balance_loss_weight": weight}
        assert maxtexts.maxtext["moe_use_megatron_seq_aux_loss"] is True
        assert maxtexts.maxtext["load_balance_loss_weight"] == weight
    assert (
        "load_balance_loss_weight"
        not in compose_resolve(TINY, "moe.impl=ours", "moe.seq_balance_loss_weight=1").maxtext
    )
    mixed = error_of(TINY, "moe.seq_balance_loss_weight=0.0001", "load_balance_loss_weight=0.01")
    assert mixed.startswith("command line: load_balance_loss_weight: is 0.01, and moe.seq_balance_loss_weight")
    assert compose_resolve("deepseek3-proxy-h200-1gpu").moe["seq_balance_loss_weight"] == 0.0001


def test_moe_fp8_needs_te_and_fp8_hardware():
    proxy = "deepseek3-proxy-h200-1gpu"
    assert compose_resolve(proxy).moe["fp8"] == "none"
    r = compose_resolve(proxy, "moe.fp8=current_scaling")
    assert r.moe["fp8"] == "current_scaling" and r.sources["moe.fp8"] == "command line"
    assert "moe.fp8: must be one of none, current_scaling, mxfp8, got 'fp4'." in error_of(proxy, "moe.fp8=fp4")
    assert (
        "command line: moe.fp8: is mxfp8, but MXFP8 (block-scaled FP8) needs Blackwell (SM100) and h200 has none."
    ) in error_of(proxy, "moe.fp8=mxfp8")
    assert (
        "command line: moe.fp8: is current_scaling, but FP8 expert GEMMs run on Transformer Engine's grouped "
        "GEMM only, and moe.gemm is tokamax. Fix: set moe.gemm: te, or moe.fp8: none."
    ) in error_of(proxy, "moe.fp8=current_scaling", "moe.gemm=tokamax")
    assert "moe.fp8: is current_scaling, but cpu has no FP8 matrix units. Fix: set moe.fp8: none" in error_of(
        TINY, "moe.impl=ours", "moe.fp8=current_scaling"
    )
    assert "moe.fp8: applies only to moe.impl: ours" in error_of(TINY, "moe.fp8=current_scaling")


def test_moe_fp8_cast_applies_to_current_scaling_only():
    proxy = "deepseek3-proxy-h200-1gpu"
    r = compose_resolve(proxy, "moe.fp8=current_scaling", "moe.fp8_cast=xla")
    assert r.moe["fp8_cast"] == "xla" and compose_resolve(proxy).moe["fp8_cast"] == "te"
    assert (
        "command line: moe.fp8_cast: is xla, which casts the expert operands of TE's per-tensor current scaling, "
        "and moe.fp8 is none. Fix: set moe.fp8: current_scaling, or remove moe.fp8_cast."
    ) in error_of(proxy, "moe.fp8_cast=xla")
    assert "moe.fp8_cast: must be one of te, xla, got 'cuda'." in error_of(proxy, "moe.fp8_cast=cuda")


def test_advice_names_the_scanned_te_step_whose_slice_fusion_runs_gemms_twice():
    from maxtext_moe.recipe import advice

    assert advice.notes(compose_resolve("deepseek3-proxy-h200-1gpu")) == []
    assert advice.notes(compose_resolve("deepseek3-proxy-h200-1gpu", "scan_layers=true")) == []  # ours-te: fusion off
    fused = ("scan_layers=true", "xla_flags.xla_gpu_enable_dynamic_slice_fusion=true")
    (note,) = advice.notes(compose_resolve("deepseek3-proxy-h200-1gpu", *fused))
    assert "dynamic-slice fusion" in note and "xla_gpu_enable_dynamic_slice_fusion=false" in note
    assert advice.notes(compose_resolve("deepseek3-proxy-h200-1gpu", *fused, "remat_policy=full")) == []
    assert advice.notes(compose_resolve("deepseek3-proxy-h200-1gpu", *fused, "moe.gemm=tokamax")) == []
    shown = subprocess.run(
        [sys.executable, "-m", "maxtext_moe", "show", "deepseek3-proxy-h200-1gpu", *fused],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert shown.splitlines()[-1] == f"# {note}"


def test_advice_names_the_uncapped_ep_buffer_and_the_attention_rerun():
    from maxtext_moe.recipe import advice

    two, one = "deepseek3-proxy-h200-2gpu", "deepseek3-proxy-h200-1gpu"
    assert advice.notes(compose_resolve(two)) == []  # capped at 1.1, attention residuals kept: as measured
    (note,) = advice.notes(compose_resolve(two, "ragged_buffer_factor=-1"))
    assert "ragged_buffer_factor is -1" in note and "EP x the routed rows" in note
    assert advice.notes(compose_resolve(two, "ragged_buffer_factor=-1", "moe.gemm=tokamax")) == []  # tokamax skips them
    (note,) = advice.notes(compose_resolve(one, "attention.residuals=recompute"))
    assert "reruns the attention forward kernel" in note and "attention.residuals: save" in note
    assert advice.notes(compose_resolve(one, "attention.residuals=recompute", "remat_policy=full")) == []
    assert advice.notes(compose_resolve(one, "moe.impl=maxtext")) == []  # MaxText's block as it is


def test_advice_names_delayed_scaling_slower_loss_and_points_to_current_scaling():
    from maxtext_moe.recipe import advice

    one = "deepseek3-proxy-h200-1gpu"
    (note,) = advice.notes(compose_resolve(one, "moe.fp8=current_scaling", "quantization=te_fp8_delayedscaling"))
    assert "quantization: te_fp8_delayedscaling" in note and "4.72" in note and "te_fp8_currentscaling" in note
    assert advice.notes(compose_resolve(one, "moe.fp8=current_scaling", "quantization=te_fp8_currentscaling")) == []
    assert advice.notes(compose_resolve("deepseek3-671b-h200-128")) == []  # the Hopper recipes: current scaling


def test_attention_section_refuses_unknown_residuals_naming_the_source():
    assert "command line: attention.residuals: must be one of recompute, save, got 'keep'." in error_of(
        TINY, "attention.residuals=keep"
    )


def test_bf16_projections_are_mla_projections_kept_out_of_te_fp8():
    fp8 = "deepseek3-proxy-h200-1gpu-fp8"
    chosen = compose_resolve(fp8, "attention.bf16_projections=[wkv_b, wkv_a, wkv_b]").attention["bf16_projections"]
    assert chosen == ["wkv_a", "wkv_b"]  # in the model's order, once each
    assert compose_resolve(fp8, "attention.bf16_projections=wq_a").attention["bf16_projections"] == ["wq_a"]
    unknown = error_of(fp8, "attention.bf16_projections=[wkv_a, wo]")
    assert "attention.bf16_projections: names 'wo', which is not an MLA projection" in unknown
    assert "list some of wq_a, wq_b, wkv_a, wkv_b" in unknown
    bf16 = error_of("deepseek3-proxy-h200-1gpu", "attention.bf16_projections=[wkv_a]")
    assert "keeps wkv_a in BF16, but quantization is 'off'" in bf16 and "include quantization/fp8-hopper" in bf16


def test_attention_kernel_fa3_needs_the_cudnn_path_it_replaces_and_hopper():
    proxy = "deepseek3-proxy-h200-1gpu"
    assert compose_resolve(proxy).attention["kernel"] == "cudnn"
    fa3 = compose_resolve(proxy, "attention.kernel=fa3").attention
    assert fa3 == {"residuals": "save", "kernel": "fa3", "bf16_projections": []}
    assert "attention.kernel: must be one of cudnn, fa3, got 'fa4'." in error_of(proxy, "attention.kernel=fa4")
    wrong_path = error_of(proxy, "attention.kernel=fa3", "attention=cudnn_flash_te")
    assert "attention.kernel: is fa3, but attention is 'cudnn_flash_te'" in wrong_path
    assert "set attention: cudnn_flash_jax" in wrong_path
    blackwell = error_of("deepseek3-671b-gb200-128", "attention.kernel=fa3", "attention=cudnn_flash_jax")
    assert "built for Hopper (sm_90a); topology.hardware is gb200" in blackwell


def test_fused_expert_weights_change_the_checkpoint_identity_and_unfused_keeps_it():
    """MaxText's `prefuse_moe_weights` stores one `wi` for wi_0 and wi_1: a checkpoint of either tree does not
    restore into the other. Off, the identity is what it was before the key was known (existing run folders)."""
    before = compose_resolve(TINY).checkpoint_identity()
    assert "prefuse_moe_weights" not in before["model"]
    assert compose_resolve(TINY, "prefuse_moe_weights=false").checkpoint_identity() == before
    fused = compose_resolve(TINY, "prefuse_moe_weights=true").checkpoint_identity()
    assert fused["model"]["prefuse_moe_weights"] is True and fused["model_digest"] != before["model_digest"]
