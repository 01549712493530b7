"""Every recipe resolves and passes MaxText's own validation; the 671B recipes say what they claim."""

from __future__ import annotations

import pytest

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition
from maxtext_moe.upstream import maxtext_config


@pytest.mark.parametrize("name", composition.recipe_names())
def test_recipe_resolves_and_maxtext_accepts_it(name: str) -> None:
    r = cli.resolve(name, [])
    maxtext_config.check(r.maxtext, r.sources)


def test_published_gb200_recipe_settings() -> None:
    r = cli.resolve("deepseek3-671b-gb200-128", [])
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


def test_full_semantics_keeps_bias_update_off_the_te_block() -> None:
    r = cli.resolve("deepseek3-671b-full-gb200-128", [])
    e = r.effective
    assert (e("n_routing_groups"), e("topk_routing_group"), e("mtp_num_layers")) == (8, 4, 1)
    assert e("routed_bias_update_rate") > 0 and e("te_moe_block") is False
    with pytest.raises(UserError, match="routed_bias_update_rate: is above 0"):
        cli.resolve(
            "deepseek3-671b-full-gb200-128",
            ["te_moe_block=true", "te_gmm_quantization=te_no_quant", "prefuse_moe_weights=true"],
        )


def test_hopper_recipes_keep_ep_in_the_node_and_refuse_mxfp8() -> None:
    for name in ("deepseek3-671b-h100-256", "deepseek3-671b-h200-128"):
        r = cli.resolve(name, [])
        assert r.effective("ici_expert_parallelism") <= r.topology.gpus_per_node
        with pytest.raises(UserError, match="MXFP8 needs Blackwell"):
            cli.resolve(name, ["te_gmm_quantization=te_mxfp8"])
