"""The recipe's `training:` section: DeepSeek-V3's schedule laid out on steps, its checks, and its MaxText keys."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.plan import budget, estimate
from maxtext_moe.recipe import composition, show, training
from maxtext_moe.recipe.validate import resolve
from maxtext_moe.upstream import training_schedule

H200 = "deepseek3-671b-h200-128"
PAPER = "configs/training/deepseek3-paper.yml"
SEQ = 4096


def compose_resolve(ref: str, *overrides: str):
    return resolve(composition.compose(ref, list(overrides)))


def error_of(ref: str, *overrides: str) -> str:
    with pytest.raises(UserError) as e:
        compose_resolve(ref, *overrides)
    return str(e.value)


@pytest.fixture(scope="module")
def paper():
    r = compose_resolve(H200)
    return r, r.training_settings.timeline()


def test_paper_schedule_at_its_breakpoints(paper) -> None:
    """arXiv 2412.19437 sec. 4.2: warm-up to 2.2e-4 over 2K steps, constant to 10T tokens, cosine to 2.2e-5 at
    14.3T, 2.2e-5 for 333B tokens, 7.3e-6 for the last 167B; gamma 0.001 then 0 at 14.3T; lambda 0.3 then 0.1."""
    _, line = paper
    assert line.lr_at(0) == 0 and line.lr_at(1000) == pytest.approx(1.1e-4) and line.lr_at(2000) == 2.2e-4
    at_10t, at_14t3, at_tail = line.step_at(10e12), line.step_at(14.3e12), line.step_at(14.633e12)
    for step in (at_10t - 1, at_10t):  # the decay starts at 10T: the step before still at the peak
        assert line.lr_at(step) == pytest.approx(2.2e-4)
    middle = (at_10t + at_14t3) // 2
    assert line.lr_at(middle) == pytest.approx((2.2e-4 + 2.2e-5) / 2, rel=1e-3)
    assert line.lr_at(at_14t3) == pytest.approx(2.2e-5) and line.lr_at(at_tail - 1) == pytest.approx(2.2e-5)
    assert line.lr_at(at_tail) == 7.3e-6 and line.lr_at(line.steps - 1) == 7.3e-6
    assert (line.mtp_weight_at(at_10t - 1), line.mtp_weight_at(at_10t)) == (0.3, 0.1)
    assert (line.bias_rate_at(at_14t3 - 1), line.bias_rate_at(at_14t3)) == (0.001, 0.0)
    # each phase starts at the first step with its tokens trained, less than one batch past them
    for tokens, step in ((10e12, at_10t), (14.3e12, at_14t3), (14.633e12, at_tail), (14.8e12, line.steps)):
        assert tokens <= line.tokens_at(step) < tokens + 15360 * SEQ
    assert line.steps == 242940


def test_paper_batch_ramp(paper) -> None:
    """3,072 to 15,360 sequences over the first 469B tokens, in whole sequences per device (128 GPUs)."""
    _, line = paper
    batches = [b for _, b in line.levels]
    assert batches[0] == 3072 and batches[-1] == 15360
    assert batches == sorted(batches) and all(b % 128 == 0 for b in batches)
    assert 469e9 <= line.tokens_at(line.ramp_steps) < 469e9 + 15360 * SEQ
    assert line.batch_at(line.ramp_steps - 1) < 15360 == line.batch_at(line.ramp_steps)
    assert line.tokens_at(1) == 3072 * SEQ
    assert 0.03 < line.extra_compute() < 0.035  # each ramp step computes 15,360 sequences


def test_paper_maxtext_keys_are_pinned_and_traced_to_the_fragment(paper) -> None:
    r, line = paper
    pinned = {
        "adam_b1": 0.9,
        "adam_b2": 0.95,
        "adam_weight_decay": 0.1,
        "gradient_clipping_threshold": 1.0,
        "max_target_length": 4096,
        "opt_type": "adamw",
    }
    for key, value in pinned.items():
        assert (r.maxtext[key], r.sources[f"maxtext.{key}"]) == (value, PAPER)
    derived = {
        "steps": line.steps,
        "learning_rate": 2.2e-4,
        "learning_rate_schedule_steps": line.steps,
        "gradient_accumulation_steps": 20,  # 15,360 = 128 GPUs x 6 sequences x 20
        "routed_bias_update_rate": 0.001,
        "mtp_loss_scaling_factor": 0.3,
    }
    for key, value in derived.items():
        assert (r.maxtext[key], r.sources[f"maxtext.{key}"]) == (value, "derived from the training section")
    assert r.sources["training.lr_tail"] == PAPER


def test_optax_schedule_in_the_step_matches_the_timeline(paper) -> None:
    _, line = paper
    schedule = training_schedule.lr_schedule(line)
    steps = [0, 1, 1999, 2000, 2001, *(s + d for s, _ in line.breakpoints()[1:] for d in (-1, 0, 1)), 200000]
    for step in steps:
        assert float(schedule(step)) == pytest.approx(line.lr_at(step), rel=1e-4), step  # optax in float32
    for points, at in ((line.bias_steps(), line.bias_rate_at), (line.mtp_steps(), line.mtp_weight_at)):
        for step in (0, *(s + d for s, _ in points for d in (-1, 0))):
            assert float(training_schedule.step_function(points, jnp.int32(step))) == pytest.approx(at(step))
    levels = tuple((s, float(b)) for s, b in line.levels)
    for step in (0, 1, line.ramp_steps - 1, line.ramp_steps, line.steps):
        assert float(training_schedule.step_function(levels, jnp.int32(step))) == line.batch_at(step)


def test_the_ramp_masks_the_loss_of_the_rows_past_the_steps_batch() -> None:
    seg = jnp.ones((6, 3), jnp.int32)
    masked = training_schedule.mask_rows({"targets_segmentation": seg, "targets": seg}, jnp.int32(4))
    assert masked["targets_segmentation"].sum(axis=1).tolist() == [3, 3, 3, 3, 0, 0]
    assert masked["targets"].sum() == 18


def test_show_prints_the_schedule_on_steps_and_names_the_deviation() -> None:
    text = show.render(cli.resolve(H200, []))
    assert f"  lr_tail:            {{14.633T: 7.3e-06}}  # {PAPER}" in text
    assert "#       2000   27.5073B   0.00022   3712   0.001    0.3  lr warm-up ends" in text
    assert "#     234993      14.3T   2.2e-05  15360       0    0.1  bias update rate 0" in text
    assert "#     242940      14.8T   7.3e-06  15360       0    0.1  end" in text
    assert "Deviation: every step computes batch_end (15360) sequences and masks the loss" in text
    assert "batch_end 15360 = per-step batch 768 x gradient accumulation 20." in text


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["training.lr_cosine_until=9T"],
            "command line: training.lr_cosine_until: lr_constant_until, lr_cosine_until, lr_tail's tokens and the "
            "run's tokens must increase, got 1e+13, 9e+12, 1.4633e+13, 1.48e+13.",
        ),
        (["training.ramp_tokens=20T"], "training.ramp_tokens: is 2e+13, as long as the run or longer"),
        (
            ["training.batch_end=15000"],
            "training.batch_end: is 15000 sequences, not a whole number of steps of per_device_batch_size x "
            "devices = 768: gradient accumulation cannot reach it. Fix: give a multiple of 768 (e.g. 15360)",
        ),
        (["training.batch_start=3000"], "training.batch_start: is 3000; the ramp needs a whole number of sequences"),
        (["training.batch_start=30720"], "up to batch_end (15360)"),
        (["training.lr_peak=-1"], "training.lr_peak: must be a number above 0, got -1."),
        (["training.bias_update_rate={0: -0.001}"], "training.bias_update_rate: has 0: -0.001;"),
        (["training.mtp_weight={1T: 0.3}"], "training.mtp_weight: starts at 1e+12 tokens; the first value must be"),
        (["training.mtp_weight={0: 0.3, 20T: 0.1}"], "training.mtp_weight: its tokens (and then the run's) must"),
        (["training.tokens=lots"], "training.tokens: must be a number above 0, got 'lots'."),
        (["training.lr_warmup_steps=200000"], "training.lr_warmup_steps: is 200000, past step 166646"),
        (["learning_rate=1e-4"], "command line: learning_rate: is set by the training: section, not directly."),
        (["gradient_accumulation_steps=4"], "gradient_accumulation_steps: is set by the training: section"),
        (["routed_bias_update_rate=0.002"], "routed_bias_update_rate: is 0.002, but training.bias_update_rate makes"),
        (["steps=300000"], "steps: is 300000, past the 242940 steps the training section's 1.48e+13 tokens take."),
        (["training.lr_peek=1"], "training.lr_peek: unknown training field. Did you mean 'lr_peak'?"),
    ],
)
def test_a_bad_schedule_is_one_user_error_before_compute(overrides: list[str], expected: str) -> None:
    assert expected in error_of(H200, *overrides)


def test_the_section_needs_its_length_and_learning_rate(recipe_file) -> None:
    path = recipe_file(
        "include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device, data/synthetic]\n"
        "training: {tokens: 1M, batch_end: 4}\n"
    )
    assert f"{path}: training.lr_peak: is missing" in error_of(str(path))


def test_a_shorter_run_keeps_the_schedule() -> None:
    r = compose_resolve(H200, "steps=20")
    assert r.maxtext["steps"] == 20 and r.maxtext["learning_rate_schedule_steps"] == 242940
    assert "# this run stops after step 20 of the schedule's 242940 (steps, command line)" in show.render(r)


def test_amounts_read_as_recipes_write_them() -> None:
    assert [training.amount(v) for v in ("14.8T", "469B", "2K", "1e12", 7, "3.5 M")] == [
        14.8e12,
        469e9,
        2000.0,
        1e12,
        7.0,
        3.5e6,
    ]
    assert training.amount("x") is None and training.amount(True) is None


def test_smoke_recipe_is_the_h200_recipe_for_ten_steps_at_two_micro_batches() -> None:
    full, smoke = compose_resolve(H200), compose_resolve(f"{H200}-smoke")
    differs = {k for k in full.maxtext.keys() | smoke.maxtext.keys() if full.maxtext.get(k) != smoke.maxtext.get(k)}
    assert differs == {"steps", "gradient_accumulation_steps", "learning_rate_schedule_steps"}
    assert (smoke.maxtext["steps"], smoke.maxtext["gradient_accumulation_steps"]) == (10, 2)
    assert [b for _, b in smoke.training_settings.timeline().levels] == [768, 1024, 1280, 1536]
    assert (smoke.topology, smoke.moe, smoke.env) == (full.topology, full.moe, full.env)


def test_plan_gives_the_days_and_gpu_hours_of_the_token_budget(paper) -> None:
    r, line = paper
    p = estimate(r)
    cost = budget.of(p, r.training_settings, r.maxtext["steps"])
    assert cost.steps == line.steps and cost.gpus == 128
    assert cost.computed_tokens == line.steps * 15360 * SEQ
    assert cost.seconds == pytest.approx(line.steps * p.step_s)  # the plan's step is one of 15,360 sequences
    assert cost.gpu_hours == pytest.approx(cost.days * 24 * 128)
    text = cost.render()
    assert "budget: 14.8T tokens (training section) in 242,940 steps" in text
    assert "DeepSeek-V3 for reference: 2.788M H800 GPU-hours in all" in text


def test_plan_of_the_smoke_run_gives_its_own_time_too() -> None:
    r = compose_resolve(f"{H200}-smoke")
    p = estimate(r)
    text = budget.of(p, r.training_settings, 10).render()
    assert f"this run stops after 10 steps: {10 * p.step_s / 3600:.2f} h" in text
