"""The planner against MaxText's own numbers: FLOPs by MaxText's formula, state memory by XLA."""

from __future__ import annotations

import contextlib
import io
import re
from math import comb

import pytest
from conftest import with_corpus

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.plan import Model, estimate, flops, layout, memory
from maxtext_moe.plan.estimate import GROUPED_GEMM_EFFICIENCY, QUANTIZE_S_PER_ELEMENT, routed_copies
from maxtext_moe.upstream import maxtext_config

GIB = 2**30


@pytest.mark.parametrize(
    "ref,overrides",
    [
        ("deepseek3-tiny-cpu", []),
        ("deepseek3-671b-published-gb200-128", []),
        ("deepseek3-671b-gb200-128", []),  # group routing + MTP
        ("deepseek3-671b-h200-128", ["max_target_length=8192", "per_device_batch_size=1"]),
    ],
)
def test_flops_match_maxtext(ref: str, overrides: list[str], prepared_corpus) -> None:
    """Our per-token count x tokens/device equals MaxText's calculate_tflops_training_per_device (per optimizer
    step: all gradient-accumulation steps)."""
    from maxtext.utils.maxtext_utils import calculate_tflops_training_per_device

    r = cli.resolve(ref, with_corpus(cli.resolve(ref, overrides).maxtext, overrides, prepared_corpus))
    config = maxtext_config.check(r.maxtext, r.sources)
    theirs, _, _ = calculate_tflops_training_per_device(config, log=False)
    f = flops.per_token(Model.from_recipe(r), config.max_target_length)
    tokens = config.per_device_batch_size * config.max_target_length * config.gradient_accumulation_steps
    ours = f.maxtext * tokens / 1e12
    assert ours == pytest.approx(theirs, rel=1e-9)


def test_deepseek_v3_published_flops_per_token() -> None:
    """~250 GFLOP/token without MTP and ~260 with one MTP layer at 4K (DESIGN.md), within 2%."""
    no_mtp = estimate(cli.resolve("deepseek3-671b-published-gb200-128", []))
    mtp = estimate(cli.resolve("deepseek3-671b-gb200-128", []))
    assert no_mtp.flops.total / 1e9 == pytest.approx(250, rel=0.02)
    assert mtp.flops.total / 1e9 == pytest.approx(260, rel=0.02)
    assert mtp.flops.maxtext < mtp.flops.total  # MaxText leaves out MTP's projection and head pass
    assert Model.from_recipe(cli.resolve("deepseek3-671b-published-gb200-128", [])).main_params / 1e9 == pytest.approx(
        671, rel=0.005
    )


def test_published_gb200_recipe_fits_and_reports_consumers() -> None:
    p = estimate(cli.resolve("deepseek3-671b-published-gb200-128", []))
    assert p.fits
    assert p.layout.fsdp == 16 and p.layout.ep == 8
    text = p.render()
    assert "-> fits" in text and "largest:" in text
    j = p.to_json()
    for key in ("fits", "memory_per_gpu_gib", "gflops_per_token", "predicted_tflops_per_gpu"):
        assert key in j
    assert sum(j["step_terms_s"].values()) == pytest.approx(j["step_time_s"])
    # Offloading the MoE up-projection moves bytes from HBM to host: none are offloaded under full remat.
    full = estimate(cli.resolve("deepseek3-671b-published-gb200-128", ["remat_policy=full"]))
    assert full.memory.host_total == 0 and p.memory.host_total > 0


def test_memory_falls_with_more_gpus_and_dedup_cuts_all_to_all() -> None:
    r = cli.resolve("deepseek3-671b-h200-128", [])
    small, big = estimate(r, gpus=32), estimate(r, gpus=128)
    assert big.memory.device["parameters"] == pytest.approx(small.memory.device["parameters"] / 4)
    assert not small.fits
    assert 0 < big.a2a["per_rank_dedup"] < big.a2a["per_expert"]


def test_unrolled_layers_count_gradients_only_beyond_the_activations() -> None:
    """Scanned, the stacked gradients and a sliced copy of the layer's weights sit next to the saved activations,
    the working set and the logits; unrolled, the peak comes before any gradient exists and the logits are
    freed before the first layer's backward. Same model and batch: unrolled plans less than scanned without
    its gradients."""
    one = "deepseek3-proxy-h200-1gpu"
    unrolled, scanned = (estimate(cli.resolve(one, [f"scan_layers={s}"])).memory for s in ("false", "true"))
    assert scanned.device["gradients"] > 0 and "gradients" not in unrolled.device
    assert scanned.device[memory.WEIGHT_COPIES] > 0 and unrolled.device[memory.WEIGHT_COPIES] == 0
    assert unrolled.device[memory.UNROLLED_GRADIENTS] == 0.0  # 7.6B parameters' gradients < the activations
    assert unrolled.device_total < scanned.device_total - scanned.device["gradients"]
    # Where the gradients outgrow the activations (a short sequence, batch 1) they count beyond them.
    tiny = estimate(cli.resolve(one, ["scan_layers=false", "per_device_batch_size=1", "max_target_length=64"])).memory
    assert tiny.device[memory.UNROLLED_GRADIENTS] > 0
    state = tiny.device["parameters"] + tiny.device["optimizer state (AdamW mu, nu)"]
    assert tiny.device_total >= 2 * tiny.device["parameters"] + tiny.device["optimizer state (AdamW mu, nu)"] > state


def test_ep_time_counts_the_bytes_the_recipes_block_sends() -> None:
    """Our block sends a token once per destination rank (in a block of T rows per peer over the default
    exchange), MaxText's once per chosen expert: the step's EP collective carries the volume of the block
    and exchange the recipe runs."""

    def ep(recipe: str, overrides: list[str]):
        p = estimate(cli.resolve(recipe, overrides))
        return next(c for c in p.collectives if c.name.startswith("EP all-to-all")), p.a2a

    two = "deepseek3-proxy-h200-2gpu"
    ours, a2a = ep(two, [])
    ragged, _ = ep(two, ["moe.exchange=ragged_all_to_all"])
    upstream, _ = ep(two, ["moe.impl=maxtext"])
    assert (ours.bytes, ragged.bytes, upstream.bytes) == (a2a["dense_blocks"], a2a["per_rank_dedup"], a2a["per_expert"])
    assert "a block of T rows per peer" in ours.name and "once per rank" in ragged.name
    # EP2: one row per token on the wire, about as many as the routing needs (a token reaches both ranks),
    # a quarter of once per expert (4 of a token's 8 copies cross on average).
    assert a2a["dense_blocks"] == pytest.approx(a2a["per_expert"] / 4)
    assert a2a["per_rank_dedup"] <= a2a["dense_blocks"] < 1.01 * a2a["per_rank_dedup"]
    # EP8: a token reaches about 5.3 of 8 ranks (4.6 rows cross), the blocks send 7 rows: as many as
    # once per expert (8 copies, 7 of 8 crossing).
    eight = estimate(cli.resolve("deepseek3-671b-h200-128", ["n_routing_groups=-1"])).a2a
    assert eight["dense_blocks"] == pytest.approx(eight["per_expert"])
    assert eight["dense_blocks"] == pytest.approx(
        7 / (8 * (1 - comb(224, 8) / comb(256, 8)) * 7 / 8) * eight["per_rank_dedup"]
    )


def test_step_terms_say_which_work_a_change_removes(capsys: pytest.CaptureFixture[str]) -> None:
    """The step is the sum of its terms, and a change moves only the terms of the work it changes. On H200s the
    671B step waits on the EP exchange: sending each token once per rank instead of XLA's blocks of T rows
    shortens only the collective on the critical path, by the bytes it saves. On H100s across 32 nodes the FSDP
    collectives outlast the compute they overlap, so a faster kernel there shortens the step not at all."""
    h200, ragged = (
        estimate(cli.resolve("deepseek3-671b-h200-128", o)) for o in ([], ["moe.exchange=ragged_all_to_all"])
    )
    for p in (h200, ragged):
        assert sum(p.terms.values()) == pytest.approx(p.step_s)
        assert p.compute_s == pytest.approx(sum(v for k, v in p.terms.items() if "collectives" not in k))
    moved = {k for k in h200.terms if h200.terms[k] != pytest.approx(ragged.terms[k])}
    assert moved == {"collectives on the critical path"}
    a2a = h200.a2a
    critical = h200.terms["collectives on the critical path"]
    assert ragged.terms["collectives on the critical path"] == pytest.approx(
        critical * a2a["per_rank_dedup"] / a2a["dense_blocks"]
    )
    assert h200.terms["overlapped collectives beyond compute"] == 0.0

    h100 = estimate(cli.resolve("deepseek3-671b-h100-256", []))
    bf16_dense = estimate(cli.resolve("deepseek3-671b-h100-256", ["quantization=''"]))
    assert h100.terms["overlapped collectives beyond compute"] > 0
    assert bf16_dense.terms["dense GEMMs"] > h100.terms["dense GEMMs"]
    assert bf16_dense.step_s == pytest.approx(h100.step_s)

    assert cli.main(["plan", "deepseek3-671b-h200-128"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("by term:"))
    assert f"collectives on the critical path {critical:.2f} s ({critical / h200.step_s:.0%})" in line
    assert "overlapped collectives beyond compute" not in line


def test_bad_planner_inputs_name_the_fix() -> None:
    r = cli.resolve("deepseek3-671b-h200-128", [])
    with pytest.raises(UserError, match=r"--gpus 100 is not a multiple of the other mesh axes \(product 8"):
        estimate(r, gpus=100)
    with pytest.raises(UserError, match=r"unknown GPU type 'h300'\. Did you mean 'h200'\?"):
        estimate(r, gpu_type="h300")
    with pytest.raises(UserError, match=r"remat_policy: is 'save_everything', which plan does not model"):
        estimate(cli.resolve("deepseek3-671b-h200-128", ["remat_policy=save_everything"]))


def test_cli_plan_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "deepseek3-671b-published-gb200-128"]) == 0
    assert "fits" in capsys.readouterr().out
    assert cli.main(["plan", "deepseek3-671b-published-gb200-128", "--gpus", "100"]) == 2
    assert "not a multiple" in capsys.readouterr().err


def test_state_memory_matches_xla_arguments_on_cpu_proxy() -> None:
    """Parameters + AdamW state as the planner counts them vs XLA's compiled argument size.

    MaxText's train_compile on XLA:CPU (compile_topology=a3 lowers for the local devices) gives the
    argument bytes of the train step: parameters, mu, nu (and a step counter). Its temp bytes are not
    compared: XLA:CPU's lowering is not the GPU's (see docs/PLAN.md).
    """
    from maxtext.trainers.pre_train import train_compile

    r = cli.resolve("deepseek3-tiny-cpu", ["per_device_batch_size=1"])
    mt = dict(
        r.maxtext,
        compile_topology="a3",
        compile_topology_num_slices=1,
        enable_checkpointing=False,
        dataset_type="synthetic",
    )
    for key in (
        "tokenizer_path",
        "tokenizer_type",
        "grain_file_type",
        "train_data_columns",
        "grain_worker_count",
        "packing",
    ):
        mt.pop(key, None)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_compile.main(maxtext_config.argv(mt))
    xla_args = int(re.search(r"argument_size_in_bytes=(\d+)", out.getvalue()).group(1))
    mem = memory.per_gpu(Model.from_recipe(r), layout.from_recipe(r))
    ours = mem.device["parameters"] + mem.device["optimizer state (AdamW mu, nu)"]
    assert ours == pytest.approx(xla_args, rel=0.02)


def test_minimal_preset_saves_what_maxtext_minimal_saves() -> None:
    """The plan's `minimal` keeps in HBM exactly the tensors MaxText's own minimal policy saves; the expert
    GEMM outputs count through the MaxText names our block gives them besides their moe_* names."""
    from jax._src.ad_checkpoint import name_p
    from maxtext.layers import nnx_decoders

    policy = nnx_decoders.NNXDecoder.minimal_policy(None)
    our_block_names = {"moe_mlpwi_0": "mlpwi_0", "moe_mlpwi_1": "mlpwi_1", "moe_mlpwo": "mlpwo"}
    saved = {t for t in layout.REMAT_TENSORS if policy(name_p, name=our_block_names.get(t, t))}
    assert saved == {t for t, where in layout.REMAT_PRESETS["minimal"].items() if where == "device"}
    assert "context" not in saved and "moe_x_sorted" not in saved


def test_fp8_current_scaling_experts_plan_at_the_fp8_peak() -> None:
    """`moe.fp8: current_scaling` runs our expert GEMMs in FP8 (TE's grouped GEMM), and bench counts the run
    against the FP8 peak: the planner must time those GEMMs at the FP8 peak and add the quantization passes,
    the rest of the step unchanged. The one-GPU recipe (unrolled, minimal) recomputes no expert GEMM."""
    one = "deepseek3-proxy-h200-1gpu"
    bf16, fp8 = (estimate(cli.resolve(one, [f"moe.fp8={mode}"])) for mode in ("none", "current_scaling"))
    assert (bf16.layout.expert_fp8, fp8.layout.expert_fp8) == (False, True)
    hw, f, lay, m = fp8.layout.hardware, fp8.flops, fp8.layout, fp8.model
    assert fp8.flops == bf16.flops and lay.remat["moe_mlpwi_0"] == "device" and not lay.scanned
    grouped_gain = (
        f.grouped_gemm
        * lay.tokens
        / GROUPED_GEMM_EFFICIENCY[lay.moe_path]
        * (1 / (hw.peak_bf16_tflops * 1e12) - 1 / (hw.peak_fp8_tflops * 1e12))
    )
    quantize = routed_copies(m, lay) * 2 * (m.emb + m.moe_mlp) * QUANTIZE_S_PER_ELEMENT
    assert 0 < quantize < grouped_gain
    assert bf16.compute_s - fp8.compute_s == pytest.approx(grouped_gain - quantize)
    assert bf16.terms["expert GEMMs"] - fp8.terms["expert GEMMs"] == pytest.approx(grouped_gain)
    cast = "FP8 expert quantization"
    assert (bf16.terms[cast], fp8.terms[cast]) == (0.0, pytest.approx(quantize))
    unchanged = set(fp8.terms) - {"expert GEMMs", cast}
    assert {k: fp8.terms[k] for k in unchanged} == {k: bf16.terms[k] for k in unchanged}


def test_fp8_proxy_recipe_is_the_bf16_proxy_with_fp8_gemms_and_more_memory() -> None:
    """`deepseek3-proxy-h200-1gpu-fp8` is the measured FP8 configuration as one command: the BF16 proxy's
    model, remat and attention, FP8 experts and dense GEMMs at batch 8, which fits only with the recipe's
    memory fraction (0.96; the BF16 recipe's 0.88 leaves too little)."""
    bf16, fp8 = cli.resolve("deepseek3-proxy-h200-1gpu", []), cli.resolve("deepseek3-proxy-h200-1gpu-fp8", [])
    assert (fp8.moe["fp8"], fp8.maxtext["quantization"], fp8.maxtext["per_device_batch_size"]) == (
        "current_scaling",
        "te_fp8_currentscaling",
        8,
    )
    same = ("remat_policy", "scan_layers", "attention", "num_experts", "base_num_decoder_layers", "max_target_length")
    assert {k: fp8.maxtext[k] for k in same} == {k: bf16.maxtext[k] for k in same}
    assert fp8.attention == bf16.attention
    assert estimate(fp8).fits
    assert not estimate(cli.resolve("deepseek3-proxy-h200-1gpu-fp8", ["env.XLA_PYTHON_CLIENT_MEM_FRACTION=0.88"])).fits


def test_scanned_te_recomputes_saved_expert_gemms_only_with_slice_fusion_on() -> None:
    """XLA's dynamic-slice fusion runs each saved expert GEMM twice in a scanned forward loop
    (scripts/repro/dynamic_slice_fusion_duplicates_gemm_in_scan.py); `moe/ours-te` turns it off, and the plan
    then times the scanned step's expert GEMMs as the unrolled one's."""
    one = "deepseek3-proxy-h200-1gpu"
    unrolled, scanned, fused = (
        estimate(cli.resolve(one, list(o)))
        for o in ((), ("scan_layers=true",), ("scan_layers=true", "xla_flags.xla_gpu_enable_dynamic_slice_fusion=true"))
    )
    assert (unrolled.layout.slice_fusion, scanned.layout.slice_fusion, fused.layout.slice_fusion) == (
        False,
        False,
        True,
    )
    assert scanned.recompute_fraction == unrolled.recompute_fraction
    assert fused.recompute_fraction > scanned.recompute_fraction


def test_our_block_places_its_up_projections_as_one_tensor() -> None:
    """Our block keeps wi_0's and wi_1's outputs as one tensor: where a custom policy places the two apart, the
    plan counts both where the layer keeps them (the outermost name not recomputed, `moe/remat_names.py`)."""
    split = ["remat_policy=custom", "moe_mlpwi_0=device", "moe_mlpwi_1=offload"]
    ours = layout.from_recipe(cli.resolve("deepseek3-proxy-h200-1gpu", split))
    upstream = layout.from_recipe(cli.resolve("deepseek3-proxy-h200-1gpu", [*split, "moe.impl=maxtext"]))
    assert (ours.placement["moe_mlpwi_0"], ours.placement["moe_mlpwi_1"]) == ("offload", "offload")
    assert (upstream.placement["moe_mlpwi_0"], upstream.placement["moe_mlpwi_1"]) == ("device", "offload")
