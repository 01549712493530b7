"""The planner's memory per GPU and step time against every proxy run's measurements (docs/results/proxy_*.json).

`maxtext-moe launch` refuses a recipe the planner says does not fit, so a planner that is high refuses
recipes that run, and one that is low lets a recipe run out of memory; `plan --search` ranks layouts by the
step time, and `bench` prints it beside the measured one. Each result file written by `maxtext-moe bench`
records the recipe, the MaxText keys it ran with and its `moe` section; these tests plan the same recipe
with those keys as overrides, as a user would, and compare.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from conftest import one_accumulation_step, recorded_scheduler_limit

from maxtext_moe import cli
from maxtext_moe.moe.settings import MoeSettings
from maxtext_moe.plan import scheduler_limit
from maxtext_moe.plan.estimate import Plan, estimate, evaluate
from maxtext_moe.recipe import maxtext_keys, moe_checks
from maxtext_moe.upstream import deviceless

GIB = 2**30
MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
TOLERANCE = 0.10
# Run bookkeeping that does not change the compiled step.
NOT_PLANNED = {
    "base_output_directory",
    "run_name",
    "steps",
    "learning_rate_schedule_steps",
    "enable_autocheckpoint",
    "enable_tensorboard",
    "enable_checkpointing",
    "save_checkpoint_on_completion",
    "profiler",
    "profiler_steps",
    "skip_first_n_steps_for_profiler",
}
# Moe fields the planner has no term for: who casts the FP8 expert operands (a record may name a cast the layer
# no longer offers, xla_weights).
MOE_NOT_PLANNED = {"fp8_cast"}
# Attention kernels the planner does not model: TE's fused attention under full remat holds about 28 GiB
# more than cuDNN through JAX at the same batch (proxy_h200_1gpu_tokamax_cudnnte*.json), from one batch
# size only, too little to tell a fixed workspace from a per-token term.
UNMODELLED_ATTENTION = {"cudnn_flash_te"}
# Runs the planner is known to miss by more than TOLERANCE, with why; the test fails if one comes within it.
KNOWN_GAPS = {
    "proxy_h200_2gpu_run5_ep2_maxtext_ragged_decomposed": (
        "MaxText's routed block under EP holds about 11 GiB more than ours on the same layout (85.4 against "
        "76.2 GiB): buffers of its permute / ragged all-to-all that carry no remat name. One measurement, at "
        "EP2 and worst-case buffers; a term fitted to it would scale with EP x top-k and refuse the 671B EP8 recipes."
    ),
    "proxy_h200_1gpu_2026-12-03_bf16_full_remat_unrolled": (
        "Unrolled full remat on one GPU: the plan holds the value and the gradient of every recomputed tensor of "
        "one layer at once (twice the layer's tensors); XLA's peak leaves about 8 GiB less (84.9 GiB against 93.6; "
        "the FP8 recipe at full remat, batch 8: 92.9 against 101.5). The scanned full-remat runs use the same "
        "working set and are 0-6% low, so lowering it would take them out of tolerance; the plan stays high here."
    ),
    "plan_compile_deviceless_671b_h100_256_scanned_accumulation15": (
        "The H100 recipe as shipped: the plan adds the accumulation loop's summed gradients (5.0 GiB) to one step's "
        "peak, 67.2 to 72.1 GiB; XLA's compile of the accumulated step peaks at 64.3, below its one step's 64.7 "
        "(the H200 recipe's accumulation adds 5.8 GiB, planned 10.0). The plan stays high (12%), on the side of "
        "refusing a launch that would fit."
    ),
}


# Rungs whose step time the planner misses by more than TOLERANCE, with why; the test fails if one comes within.
_TOKAMAX_EP2 = (
    "tokamax's grouped GEMM under EP2: the profile (proxy_h200_2gpu_run7_ep2_ours_tokamax_profile.json) shows "
    "each GPU busy about 53% of the step, its ragged-dot kernels at about half of peak; the idle time is not "
    "explained by any kernel or collective, so the planner has no term for it (13-15% optimistic)."
)
_UNRECORDED_BLOCK = (
    "recorded before bench wrote the moe section, so it is planned as MaxText's block; its name and its time "
    "(0.46 s, as proxy_h200_1gpu_run4_ours_full_profile's ours/TE) say it ran our block on TE."
)
KNOWN_STEP_GAPS = {
    "proxy_h200_2gpu_run5_ep2_maxtext_ragged_decomposed": _TOKAMAX_EP2,
    "proxy_h200_2gpu_run5_ep2_ours_tokamax_ragged_decomposed": _TOKAMAX_EP2,
    "proxy_h200_2gpu_run6_ep2_ours_tokamax_all_to_all": _TOKAMAX_EP2,
    "proxy_h200_2gpu_run7_ep2_ours_tokamax_lhs_collective_flags": _TOKAMAX_EP2,
    "proxy_h200_2gpu_run7_ep2_ours_tokamax_profile": _TOKAMAX_EP2,
    "proxy_h200_1gpu_run3_ours_te_full": _UNRECORDED_BLOCK,
    "proxy_h200_1gpu_run3_ours_te_minimal": _UNRECORDED_BLOCK,
}


def overrides(result: dict) -> list[str]:
    """The run's MaxText keys and moe section as command-line overrides.

    `settings` holds every key the recipe set when the run was made; a key the recipe has set since
    (e.g. ragged_buffer_factor) ran at MaxText's default. Results written before `bench` recorded the moe
    section ran MaxText's own block; a moe field missing from an older record had not been added yet, and
    those runs behaved as its `recompute`/`auto`/0 value. The attention section is recorded since it has one,
    and the environment (XLA_FLAGS among it) since `bench` writes it."""
    settings = dict(result["settings"])
    recipe = cli.resolve(result["recipe"], [])
    model_defaults = maxtext_keys.model_defaults(str(settings.get("model_name", "default")))
    for key in recipe.maxtext.keys() - settings.keys():
        settings[key] = model_defaults.get(key, maxtext_keys.defaults().get(key))
    moe = dict(result.get("moe") or {"impl": "maxtext"})
    moe.setdefault("seq_balance_loss_weight", 0)  # records made before the loss was in the model ran without it
    derived = moe_checks.maxtext_keys(MoeSettings.from_dict(moe)).keys()  # the moe section sets them again
    keys = [f"{k}={json.dumps(v)}" for k, v in settings.items() if k not in NOT_PLANNED and k not in derived]
    # Records made before attention.residuals had its own section kept it in moe, for our block only.
    attention = result.get("attention") or {"residuals": moe.pop("attention_residuals", "recompute")}
    env = result.get("env") or {}
    fraction = [f"env.{MEM_FRACTION}={env[MEM_FRACTION]}"] if MEM_FRACTION in env else []
    # A run whose recorded XLA_FLAGS leave dynamic-slice fusion out ran with XLA's default, on.
    fusion = re.search(r"--xla_gpu_enable_dynamic_slice_fusion=(\w+)", env.get("XLA_FLAGS", ""))
    return (
        keys
        + [f"moe.{k}={v}" for k, v in moe.items() if k not in MOE_NOT_PLANNED]
        + [f"attention.{k}={v}" for k, v in attention.items()]
        + fraction
        + [f"xla_flags.xla_gpu_enable_dynamic_slice_fusion={fusion.group(1) if fusion else 'true'}"]
    )


def measured_runs() -> list[tuple[str, dict]]:
    runs = []
    for path in sorted(RESULTS.glob("proxy_*.json")):
        result = json.loads(path.read_text())
        if result.get("peak_device_memory_gib") is None:
            continue
        if result["settings"].get("attention") in UNMODELLED_ATTENTION:
            continue
        runs.append((path.stem, result))
    return runs


def planned(result: dict) -> Plan:
    """The plan of the code a record ran: our block weighted the routed copies after wo (its backward then read
    wo's output) in every record that does not say where it weights them (`bench`'s `routing_weights`)."""
    resolved = cli.resolve(result["recipe"], overrides(result))
    plan = estimate(resolved)
    if not plan.layout.weights_before_wo or result.get("routing_weights") == "before wo":
        return plan
    lay = dataclasses.replace(plan.layout, weights_before_wo=False)
    groups = int(resolved.effective("n_routing_groups")), int(resolved.effective("topk_routing_group"))
    return evaluate(resolved.name, plan.model, lay, *groups)


def check(measured: dict[str, float], predicted: dict[str, float], gaps: dict[str, str], unit: str) -> None:
    """Every run within TOLERANCE but the known gaps, and no known gap that has closed."""
    rows, worst, closed = [], 0.0, []
    for name, value in measured.items():
        error = (predicted[name] - value) / value
        if name in gaps:
            closed += [name] if abs(error) <= TOLERANCE else []
        else:
            worst = max(worst, abs(error))
        gap = " (known gap)" if name in gaps else ""
        rows.append(f"{name:60s} measured {value:6.3g}  planned {predicted[name]:6.3g} {unit}  {error:+6.1%}{gap}")
    table = "\n".join(rows)
    assert worst <= TOLERANCE, f"worst |planned - measured| / measured {worst:.1%} > {TOLERANCE:.0%}:\n{table}"
    assert not closed, f"now within {TOLERANCE:.0%}, remove from the known gaps: {closed}\n{table}"


def test_every_measured_run_is_collected() -> None:
    """The table covers one and two GPUs, scanned and unrolled, both remat presets and both MoE blocks."""
    runs = [r for _, r in measured_runs()]
    assert len(runs) >= 40
    assert {r["devices"] for r in runs} == {1, 2}
    assert {r["settings"]["scan_layers"] for r in runs} == {True, False}
    assert {r["settings"]["remat_policy"] for r in runs} >= {"full", "minimal", "minimal_offloaded"}
    assert {(r.get("moe") or {"impl": "maxtext"})["impl"] for r in runs} == {"ours", "maxtext"}


def test_planned_memory_within_tolerance_of_measured_peak() -> None:
    runs = measured_runs()
    measured = {name: r["peak_device_memory_gib"] for name, r in runs}
    check(measured, {name: planned(r).memory.device_total / GIB for name, r in runs}, KNOWN_GAPS, "GiB")


def test_planned_step_time_within_tolerance_of_measured_median() -> None:
    """What `plan` and `bench` print as the predicted step against `bench`'s median step on every rung:
    one GPU and EP2, BF16 and FP8 experts, both blocks, scanned and unrolled, every remat policy."""
    runs = [(name, r) for name, r in measured_runs() if r.get("step_s_median")]
    assert len(runs) >= 40
    assert {r["devices"] for _, r in runs} == {1, 2}
    assert {(r.get("moe") or {}).get("fp8", "none") for _, r in runs} == {"none", "current_scaling"}
    measured = {name: r["step_s_median"] for name, r in runs}
    check(measured, {name: planned(r).step_s for name, r in runs}, KNOWN_STEP_GAPS, "s")


def test_every_measured_peak_within_what_the_planner_calls_usable() -> None:
    """A run that ran is one `launch` must let run: its peak device memory within the planner's usable memory
    at the memory fraction it ran with (recorded as `env` since bench writes it; the recipe's before)."""
    over = []
    for name, r in measured_runs():
        usable = planned(r).layout.usable_gib
        if r["peak_device_memory_gib"] > usable:
            over.append(f"{name}: {r['peak_device_memory_gib']:.1f} GiB > {usable:.1f} usable")
    assert not over, over


def test_usable_memory_is_the_share_xla_allocator_had() -> None:
    """XLA's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of the memory CUDA reports: MaxText logged its
    limit on the H200 at the recipe's 0.88 (`Using (GB) used / limit`) when batch 8 ran out of memory."""
    log = (RESULTS / "proxy_h200_1gpu_2026-12-01_night_call5_fp8_dense_b8_oom.txt").read_text()
    limit = float(re.search(r"Using \(GB\) [\d.]+ / ([\d.]+)", log).group(1))
    usable = estimate(cli.resolve("deepseek3-proxy-h200-1gpu", [])).layout.usable_gib
    assert usable == pytest.approx(limit, rel=0.002)


@pytest.mark.parametrize("recipe", ["deepseek3-proxy-h200-1gpu", "deepseek3-proxy-h200-2gpu"])
def test_shipped_proxy_recipes_fit(recipe: str) -> None:
    """The recipes measured to run must be accepted by `launch`."""
    assert estimate(cli.resolve(recipe, [])).fits


# The 671B recipes with unrolled layers at full remat, one accumulation step: docs/results/NAME.json.
UNROLLED = ("scan_layers=false", "memory=full-remat")
UNROLLED_671B = {
    "deepseek3-671b-h200-128": "plan_compile_deviceless_671b_h200_128_tied",
    "deepseek3-671b-h100-256": "plan_compile_deviceless_671b_h100_256_tied",
    "deepseek3-671b-gb200-128": "plan_compile_deviceless_671b_gb200_128_tied",
    "deepseek3-671b-gb300-1024": "plan_compile_deviceless_671b_gb300_1024_tied",
}
# Unrolled, the Blackwell recipes' temporaries fill XLA's scheduler budget on a GB200 / GB300 (144.1 and
# 210.3 GiB, tests/unit/test_scheduler_limit.py): buffers held early for overlap, XLA's choice and not the
# step's floor. Compiled with the budget the plan gives them (`SchedulerLimit.slop_for`), they keep near it.
AT_PLAN_BUDGET = {
    "deepseek3-671b-gb200-128": ("plan_compile_deviceless_671b_gb200_128_budget_plan", 51),
    "deepseek3-671b-gb300-1024": ("plan_compile_deviceless_671b_gb300_1024_budget_plan", 31),
}
# The compile each recipe's unrolled plan is held to, and the slop factor it ran with.
COMPILED_671B = {
    recipe: AT_PLAN_BUDGET.get(recipe, (name, scheduler_limit.DEFAULT_SLOP_PERCENT))
    for recipe, name in UNROLLED_671B.items()
}


def compiled_record(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def test_planned_memory_within_tolerance_of_every_compiled_671b_recipe() -> None:
    """XLA's per-GPU total for each 671B recipe with unrolled layers, compiled for its full device count, against
    `plan`'s now (the compiled JSON keeps the plan of its day too); the state argument against the planned state
    to 1%."""
    plans = {
        recipe: estimate(cli.resolve(recipe, one_accumulation_step(recipe, *UNROLLED))) for recipe in COMPILED_671B
    }
    runs = {recipe: compiled_record(name) for recipe, (name, _) in COMPILED_671B.items()}
    compiled = {recipe: r["compiled"]["device_total_bytes"] / GIB for recipe, r in runs.items()}
    check(compiled, {recipe: p.memory.device_total / GIB for recipe, p in plans.items()}, {}, "GiB")
    for recipe, r in runs.items():
        assert abs(r["state_compiled_over_planned"] - 1) < 0.01, recipe


def test_the_budgets_compiled_with_are_the_ones_the_plans_ask_for() -> None:
    """The slop factor each budgeted compile ran with is the one `plan --compile` names for the recipe, so the
    records stay tied to the plan (and to XLA's rule) they were made for."""
    for recipe, (_, slop) in COMPILED_671B.items():
        resolved = cli.resolve(recipe, one_accumulation_step(recipe, *UNROLLED))
        device_memory = deviceless.device_memory_bytes(resolved.topology.profile)
        limit = recorded_scheduler_limit(compiled_record(UNROLLED_671B[recipe])["compiled"], device_memory)
        planned = estimate(resolved).memory.device_total
        if slop == scheduler_limit.DEFAULT_SLOP_PERCENT:
            assert limit.verdict(planned).startswith("within it"), recipe
        else:
            assert limit.slop_for(planned) == slop, recipe


# Each 671B recipe as it ships (scanned layers, accumulated to the training section's batch, XLA's default
# scheduler budget), compiled deviceless with the current code.
SHIPPED_671B = {
    "deepseek3-671b-h200-128": "plan_compile_deviceless_671b_h200_128_scanned_accumulation20",
    "deepseek3-671b-h100-256": "plan_compile_deviceless_671b_h100_256_scanned_accumulation15",
    "deepseek3-671b-gb200-128": "plan_compile_deviceless_671b_gb200_128_scanned_offload_accumulation20",
    "deepseek3-671b-gb300-1024": "plan_compile_deviceless_671b_gb300_1024_scanned_offload_accumulation2",
}


def test_every_671b_recipe_as_shipped_compiles_within_its_usable_hbm_and_host_memory() -> None:
    for recipe, name in SHIPPED_671B.items():
        plan = estimate(cli.resolve(recipe, []))
        compiled = compiled_record(name)["compiled"]
        assert compiled["device_total_bytes"] / GIB <= plan.layout.usable_gib, recipe
        assert compiled["host_total_bytes"] <= plan.layout.hardware.host_mem_gb * 1e9, recipe
        assert compiled["host_total_bytes"] == pytest.approx(plan.memory.host_total, rel=0.1, abs=GIB), recipe


# The 671B recipes with scanned layers (scan_layers=true), compiled deviceless for their full device counts:
# record -> (recipe, one accumulation step or as shipped, memory preset). On Blackwell XLA's default budget lets
# the scheduler hold more than the step needs (within that budget); as for unrolled layers, the plan is held to
# the compile at the budget it asks for (`SchedulerLimit.slop_for`, the `_budget_plan` records) and the default
# one stays above it.
FULL, OFFLOAD = "full-remat", "offload-moe-up"
_GB200, _GB300 = "plan_compile_deviceless_671b_gb200_128_scanned", "plan_compile_deviceless_671b_gb300_1024_scanned"
SCANNED_AT_DEFAULT_BUDGET = {
    _GB200: ("deepseek3-671b-gb200-128", True, FULL),
    _GB300: ("deepseek3-671b-gb300-1024", True, FULL),
    f"{_GB200}_offload": ("deepseek3-671b-gb200-128", True, OFFLOAD),
    f"{_GB200}_offload_accumulation20": ("deepseek3-671b-gb200-128", False, OFFLOAD),
    f"{_GB300}_offload": ("deepseek3-671b-gb300-1024", True, OFFLOAD),
    f"{_GB300}_offload_accumulation2": ("deepseek3-671b-gb300-1024", False, OFFLOAD),
}
SCANNED_671B = {
    "plan_compile_deviceless_671b_h200_128_scanned": ("deepseek3-671b-h200-128", True, FULL),
    "plan_compile_deviceless_671b_h200_128_scanned_accumulation20": ("deepseek3-671b-h200-128", False, FULL),
    "plan_compile_deviceless_671b_h100_256_scanned": ("deepseek3-671b-h100-256", True, FULL),
    "plan_compile_deviceless_671b_h100_256_scanned_accumulation15": ("deepseek3-671b-h100-256", False, FULL),
    **{f"{name}_budget_plan": spec for name, spec in SCANNED_AT_DEFAULT_BUDGET.items()},
}


def scanned_plan(recipe: str, one_step: bool, memory: str) -> Plan:
    keys = ["scan_layers=true", f"memory={memory}"]
    return estimate(cli.resolve(recipe, one_accumulation_step(recipe, *keys) if one_step else keys))


def test_planned_memory_within_tolerance_of_every_compiled_scanned_671b_recipe() -> None:
    """XLA's per-GPU total for each 671B recipe with scanned layers against `plan`'s now, one accumulation step
    and as shipped (the summed gradients carried through the accumulation loop), at full remat and with the MoE
    up-projection offloaded; the state to 1%, the offloaded host memory to 10%."""
    runs = {name: compiled_record(name) for name in SCANNED_671B}
    compiled = {name: r["compiled"]["device_total_bytes"] / GIB for name, r in runs.items()}
    plans = {name: scanned_plan(*spec) for name, spec in SCANNED_671B.items()}
    for name, (_, one_step, _) in SCANNED_671B.items():
        assert (plans[name].layout.grad_accum == 1) == one_step, name
        assert abs(runs[name]["state_compiled_over_planned"] - 1) < 0.01, name
        host = runs[name]["compiled"]["host_total_bytes"]
        assert host == pytest.approx(plans[name].memory.host_total, rel=0.1, abs=GIB), name
    check(compiled, {name: p.memory.device_total / GIB for name, p in plans.items()}, KNOWN_GAPS, "GiB")


def test_scanned_blackwell_compiles_ran_at_the_budget_their_plans_ask_for() -> None:
    """Each Blackwell compile the scanned plan is held to ran with the slop factor `plan --compile` names for the
    plan (the budget read from the default compile); at the default budget XLA filled more than the plan, within
    the budget, buffers held early for overlap."""
    for name, spec in SCANNED_AT_DEFAULT_BUDGET.items():
        plan = scanned_plan(*spec)
        device_memory = deviceless.device_memory_bytes(plan.layout.hardware)
        default = compiled_record(name)["compiled"]
        limit = recorded_scheduler_limit(default, device_memory)
        planned = plan.memory.device_total
        budgeted = compiled_record(f"{name}_budget_plan")["compiled"]
        assert f"--xla_gpu_memory_limit_slop_factor={limit.slop_for(planned)}" in budgeted["xla_flags"], name
        assert limit.verdict(planned).startswith("within it"), name
        assert default["device_total_bytes"] > planned, name


GB200 = "deepseek3-671b-gb200-128"
OFFLOAD_MOE_UP = ("remat_policy=custom", "decoder_layer_input=device", "moe_mlpwi_0=offload", "moe_mlpwi_1=offload")


@pytest.mark.parametrize(
    ("records", "policy"),
    [(("5layers", "9layers"), OFFLOAD_MOE_UP), (("5layers_full_remat", "9layers_full_remat"), ("remat_policy=full",))],
)
def test_planned_hbm_per_unrolled_moe_layer_matches_the_compiled_gb200_recipe(
    records: tuple[str, str], policy: tuple[str, ...]
) -> None:
    """The GB200 recipe compiled deviceless at 5 and 9 layers (four more MoE layers), its MoE up-projection
    offloaded to host and with full remat. Offloaded, each unrolled MoE layer added 2.8 GiB of HBM, as much as
    saving the tensors on the device: XLA copied them to host only before each layer's backward. The plan's
    step per layer within 10% of XLA's; its totals are 10-17% below XLA's at these depths (the H200 recipe's
    5-layer variant: 8%), held within 20%."""
    runs = [json.loads((RESULTS / f"plan_compile_deviceless_671b_gb200_128_{r}.json").read_text()) for r in records]
    compiled = [r["compiled"]["device_total_bytes"] / GIB for r in runs]
    planned = [
        estimate(
            cli.resolve(GB200, one_accumulation_step(GB200, f"base_num_decoder_layers={n}", *UNROLLED, *policy))
        ).memory.device_total
        / GIB
        for n in (5, 9)
    ]
    assert planned[1] - planned[0] == pytest.approx(compiled[1] - compiled[0], rel=0.1)
    for p, c in zip(planned, compiled, strict=True):
        assert abs(p / c - 1) < 0.2, (planned, compiled)


def test_planned_hbm_of_the_offloading_gb200_recipe_within_10_percent_of_its_full_compile() -> None:
    """The GB200 recipe as first shipped (MoE up-projection offloaded), compiled for 128 GB200s in full: 203.0
    GiB per GPU, 118 up-projection outputs (112.5 GiB) in HBM at the peak. The plan said 88.9 before it counted
    them; it must keep saying the recipe does not fit."""
    run = json.loads((RESULTS / "plan_compile_deviceless_671b_gb200_128_offload.json").read_text())
    plan = estimate(cli.resolve(GB200, one_accumulation_step(GB200, *UNROLLED, *OFFLOAD_MOE_UP)))
    assert plan.memory.device_total / run["compiled"]["device_total_bytes"] == pytest.approx(1.0, abs=0.1)
    assert not plan.fits


def test_planned_hbm_of_the_gb300_recipe_with_its_moe_up_projection_saved_within_10_percent_of_its_compile() -> None:
    """The GB300 recipe with the MoE up-projection outputs saved in HBM instead of full remat, compiled for 1,024
    GB300s at XLA's default budget: 209.2 GiB per GPU, planned 199.5, of the 236.0 usable (JAX's cuDNN attention
    standing in for TE's, which the recipe runs and which held more on the H200 proxy: why it is not shipped)."""
    run = compiled_record("plan_compile_deviceless_671b_gb300_1024_moe_up_in_hbm")
    saved = ("remat_policy=custom", "decoder_layer_input=device", "moe_mlpwi_0=device", "moe_mlpwi_1=device")
    plan = estimate(
        cli.resolve("deepseek3-671b-gb300-1024", one_accumulation_step("deepseek3-671b-gb300-1024", *UNROLLED, *saved))
    )
    assert plan.memory.device_total / run["compiled"]["device_total_bytes"] == pytest.approx(1.0, abs=0.1)
    assert plan.fits and run["compiled"]["host_total_bytes"] == 0


def test_planned_hbm_that_gradient_accumulation_adds_matches_the_compiled_h200_recipe() -> None:
    """Five layers of the H200 recipe compiled deviceless, one step of the per-device batch and accumulated 20
    times to the paper's batch as shipped: what accumulation adds to XLA's total (1.25 GiB: the summed
    gradients and the routed expert weights laid out for the FSDP gather, kept through the loop) within 20% of
    what it adds to the plan; the accumulated step within 15% of its plan."""
    recipe, five = "deepseek3-671b-h200-128", ("base_num_decoder_layers=5", *UNROLLED)
    one = compiled_record("plan_compile_deviceless_671b_h200_128_5layers_one_step_2026-12-03")
    accumulated = compiled_record("plan_compile_deviceless_671b_h200_128_5layers_accumulation20")
    plans = [estimate(cli.resolve(recipe, o)) for o in (one_accumulation_step(recipe, *five), list(five))]
    assert plans[1].layout.grad_accum == 20
    planned = [p.memory.device_total / GIB for p in plans]
    compiled = [r["compiled"]["device_total_bytes"] / GIB for r in (one, accumulated)]
    assert planned[1] - planned[0] == pytest.approx(compiled[1] - compiled[0], rel=0.2), (planned, compiled)
    assert compiled[1] / planned[1] < 1.15, (planned, compiled)


# Deviceless compiles on the 2-core machine, one accumulation step: record -> (recipe, decoder layers, scanned).
COMPILE_TIMES = {
    **{name: (recipe, 61, False) for recipe, name in UNROLLED_671B.items()},
    **{
        f"plan_compile_deviceless_671b_{name}": (recipe, 61, True)
        for name, recipe in (
            ("h100_256_scanned", "deepseek3-671b-h100-256"),
            ("h200_128_scanned", "deepseek3-671b-h200-128"),
            ("gb200_128_scanned_offload", GB200),
            ("gb300_1024_scanned_offload", "deepseek3-671b-gb300-1024"),
        )
    },
    "plan_compile_deviceless_671b_h200_128_5layers_one_step_2026-12-03": ("deepseek3-671b-h200-128", 5, False),
    "plan_compile_deviceless_671b_h200_128_9layers_tied": ("deepseek3-671b-h200-128", 9, False),
    "plan_compile_deviceless_671b_gb200_128_5layers_full_remat": (GB200, 5, False),
    "plan_compile_deviceless_671b_gb200_128_9layers_full_remat": (GB200, 9, False),
}


def test_planned_compile_time_against_every_deviceless_compile() -> None:
    """`plan`'s compile time against the compiles it is fitted to, all on the same 2-core machine: the unrolled
    61-layer steps within 10% (the fit's own points, one scale per GPU generation), the 5- and 9-layer ones
    within 60% (the layer exponent), the scanned ones within 50% (one figure for every layout)."""
    from maxtext_moe.plan import compile_time

    for name, (recipe, layers, scanned) in COMPILE_TIMES.items():
        keys = one_accumulation_step(recipe, f"base_num_decoder_layers={layers}", f"scan_layers={str(scanned).lower()}")
        plan = estimate(cli.resolve(recipe, keys))
        ratio = compile_time.seconds(plan.model, plan.layout) / compiled_record(name)["compiled"]["compile_s"]
        tolerance = 0.5 if scanned else 0.1 if layers == 61 else 0.6
        assert abs(ratio - 1) < tolerance, (name, ratio)
