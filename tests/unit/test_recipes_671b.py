"""Every recipe resolves and passes MaxText's own validation; the 671B recipes say what they claim."""

from __future__ import annotations

import pytest
from conftest import with_corpus

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition, show
from maxtext_moe.upstream import maxtext_config


@pytest.mark.parametrize("name", composition.recipe_names())
def test_recipe_resolves_and_maxtext_accepts_it(name: str, prepared_corpus) -> None:
    """As a user launches it: a recipe that trains on a prepared corpus gets one (data/prepared)."""
    r = cli.resolve(name, with_corpus(cli.resolve(name, []).maxtext, [], prepared_corpus))
    maxtext_config.check(r.maxtext, r.sources)


def test_published_gb200_recipe_settings() -> None:
    r = cli.resolve("deepseek3-671b-published-gb200-128", [])
    assert r.topology.num_devices == 128
    e = r.effective
    assert (e("ici_fsdp_parallelism"), e("ici_expert_parallelism")) == (-1, 8)
    assert (e("per_device_batch_size"), e("max_target_length")) == (6, 4096)
    assert (e("te_moe_block"), e("te_gmm_quantization"), e("quantization")) == (
        True,
        "te_mxfp8",
        "te_fp8_currentscaling",
    )
    assert (e("attention"), e("n_routing_groups"), e("mtp_num_layers"), e("routed_bias_update_rate")) == (
        "cudnn_flash_te",
        -1,
        0,
        0.0,
    )
    assert (e("moe_mlpwi_0"), e("moe_mlpwi_1"), e("remat_policy")) == ("offload", "offload", "custom")
    assert r.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.88" and r.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "16"
    flags = r.env["XLA_FLAGS"]
    for flag in (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "all_gather_combine_threshold_bytes=6442450944",
        "reduce_scatter_combine_threshold_bytes=201326592",
        "all_reduce_combine_threshold_bytes=33554432",
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,DYNAMIC_SLICE_FUSION",
    ):
        assert flag in flags


OURS_671B = {
    "deepseek3-671b-h100-256": "current_scaling",
    "deepseek3-671b-h200-128": "current_scaling",
    "deepseek3-671b-gb200-128": "mxfp8",
    "deepseek3-671b-gb300-1024": "mxfp8",
}


@pytest.mark.parametrize(("name", "fp8"), OURS_671B.items())
def test_671b_recipes_train_deepseek_v3_as_trained_on_our_block(name: str, fp8: str) -> None:
    """The paper's semantics: sigmoid scores, 8 groups / top-4, top-8 of 256 experts, scaling 2.5, bias update
    rate 0.001, 1 shared expert, 3 dense layers, 1 MTP layer; our block with FP8 experts."""
    r = cli.resolve(name, [])
    e = r.effective
    assert (e("n_routing_groups"), e("topk_routing_group"), e("num_experts"), e("num_experts_per_tok")) == (
        8,
        4,
        256,
        8,
    )
    assert (e("routed_score_func"), e("routed_scaling_factor"), e("routed_bias_update_rate")) == ("sigmoid", 2.5, 0.001)
    assert (e("shared_experts"), e("first_num_dense_layers"), e("mtp_num_layers")) == (1, 3, 1)
    assert e("te_moe_block") is False
    assert (r.moe["impl"], r.moe["gemm"], r.moe["fp8"]) == ("ours", "te", fp8)
    assert r.effective("ici_expert_parallelism") == 8
    # DeepSeek-V3's sequence-wise balance loss, alpha 0.0001, summed over the MoE layers; no batch-wise loss.
    assert r.moe["seq_balance_loss_weight"] == 0.0001 and r.sources["moe.seq_balance_loss_weight"] == (
        "configs/model/deepseek3-671b-full.yml"
    )
    assert (e("moe_use_megatron_seq_aux_loss"), e("load_balance_loss_weight")) == (True, 0.0)


def test_te_block_still_refuses_the_bias_update() -> None:
    with pytest.raises(UserError, match="routed_bias_update_rate: is above 0"):
        cli.resolve(
            "deepseek3-671b-published-gb200-128",
            ["routed_bias_update_rate=0.001"],
        )


def test_hopper_recipes_keep_ep_in_the_node_and_refuse_mxfp8() -> None:
    for name in ("deepseek3-671b-h100-256", "deepseek3-671b-h200-128"):
        r = cli.resolve(name, [])
        assert r.effective("ici_expert_parallelism") <= r.topology.gpus_per_node
        with pytest.raises(UserError, match="MXFP8 needs Blackwell"):
            cli.resolve(name, ["te_gmm_quantization=te_mxfp8"])


def test_show_names_the_published_recipes_routing_differences() -> None:
    published = show.render(cli.resolve("deepseek3-671b-published-gb200-128", []))
    note = next(line for line in published.splitlines() if "routing differs" in line)
    assert "no group-limited routing" in note and "no bias update" in note and "no MTP layer" in note
    for name in OURS_671B:
        assert "routing differs" not in show.render(cli.resolve(name, []))
    partial = show.render(cli.resolve("deepseek3-671b-h200-128", ["mtp_num_layers=0"]))
    assert "routing differs from DeepSeek-V3 as trained: no MTP layer (mtp_num_layers 0)." in partial
