"""`maxtext-moe bench`: time a recipe's real training steps and report them against the plan.

MaxText prints a per-step TFLOP/s by its own count, but no median over a steady window, no MFU
against a stated peak, no peak device memory, and no comparison with a prediction. This module runs
the recipe through the same launcher as `train` (warm-up steps, then timed steps, no checkpoints),
reads MaxText's per-step scalars back, and reports median/min/max step time, tokens/s/GPU, model
TFLOPS/GPU by the planner's FLOPs-per-token convention, MFU, peak device memory and the planner's
predicted step time. A run whose loss is not finite or not falling over the timed steps is still
reported (the figures are what they are) but marked, and the command then exits non-zero.
"""

from __future__ import annotations

import dataclasses
import math
import resource
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.plan.flops import Flops
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.run import train
from maxtext_moe.run.progress import read_metrics
from maxtext_moe.tools import profile as traces

FP8_KEYS = ("quantization", "te_gmm_quantization")


@dataclass(frozen=True)
class BenchResult:
    recipe: str
    hardware: str
    devices: int
    warmup_steps: int
    timed_steps: int
    step_s_median: float
    step_s_min: float
    step_s_max: float
    tokens_per_step: int
    tokens_per_s_per_gpu: float
    gflops_per_token: float
    mtp_layers: int
    model_tflops_per_gpu: float
    maxtext_tflops_per_gpu: float
    mfu_bf16: float | None
    mfu_fp8: float | None
    peak_device_memory_gib: float | None
    host_peak_rss_gib: float
    predicted_step_s: float | None
    loss_first: float
    loss_last: float
    losses: list[float]  # every timed step's, for loss curves (benchmarks/loss_curves.py)
    loss_finite_and_falling: bool  # mean of the second half of the timed steps below the first half's
    date: str
    settings: dict[str, Any]  # the MaxText keys the bench ran with
    moe: dict[str, Any]  # the recipe's moe section (which routed-MoE block and grouped GEMM)
    attention: dict[str, Any]  # the recipe's attention section (residuals kept or recomputed)
    profile: dict[str, Any] | None = None  # tools.profile summary of two warm-up steps (--profile)
    device_memory_limit_gib: float | None = None  # what XLA's allocator had: the planner's usable memory
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # the recipe's process environment
    # Where the routed block applies the routing weights: "before wo" (ours, `moe/layer.py`: no wo output kept
    # for the backward) or "after wo" (MaxText's); the planner's memory depends on it. None: not recorded.
    routing_weights: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def render(self) -> str:
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        mem = "n/a" if self.peak_device_memory_gib is None else f"{self.peak_device_memory_gib:.1f} GiB"
        if self.peak_device_memory_gib is not None and self.device_memory_limit_gib:
            mem += f" of the {self.device_memory_limit_gib:.1f} XLA's allocator had"
        rows = [
            ("recipe", f"{self.recipe} on {self.devices} x {self.hardware}"),
            ("MoE block", ", ".join(f"{k} {v}" for k, v in self.moe.items())),
            ("steps", f"{self.warmup_steps} warm-up + {self.timed_steps} timed"),
            ("step time", f"median {self.step_s_median:.3f} s (min {self.step_s_min:.3f}, max {self.step_s_max:.3f})"),
            (
                "predicted step time",
                "n/a (no device peak)"
                if self.predicted_step_s is None
                else f"{self.predicted_step_s:.3f} s (maxtext-moe plan)",
            ),
            ("tokens/s/GPU", f"{self.tokens_per_s_per_gpu:,.0f}"),
            (
                "model TFLOPS/GPU",
                f"{self.model_tflops_per_gpu:.1f} ({self.gflops_per_token:.2f} GFLOP/token, "
                f"MTP layers: {self.mtp_layers}); MaxText's count {self.maxtext_tflops_per_gpu:.1f}",
            ),
            (
                "MFU",
                f"{pct(self.mfu_bf16)} of BF16 dense peak"
                + (f", {pct(self.mfu_fp8)} of FP8 peak" if self.mfu_fp8 is not None else ""),
            ),
            ("peak device memory", mem),
            ("host peak RSS", f"{self.host_peak_rss_gib:.1f} GiB"),
            ("loss", f"{self.loss_first:.4f} -> {self.loss_last:.4f} over the timed steps"),
        ]
        if self.profile:
            rows.append(("profile (warm-up)", f"{self.profile['trace']}"))
            rows += profile_rows(self.profile, self.step_s_median)
            rows += [
                (f"  busy {p['plane']}", f"{p['busy_ms'] / p['span_ms']:.0%} of the traced span")
                for p in self.profile.get("per_plane", [])
                if p["span_ms"]
            ]
            rows += [
                (f"  idle {gap}", f"{ms / len(PROFILED_STEPS):.1f} ms/step in {n // len(PROFILED_STEPS)} gaps")
                for gap, ms, n in self.profile.get("idle_after", [])[:8]
            ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def profile_rows(profile: dict[str, Any], step_s: float) -> list[tuple[str, str]]:
    """Per traced step: each stage's time, its share of the median step `step_s` and (GEMM stages) achieved
    TFLOP/s against the matmul rate, then the step time no kernel covered; or the kernel categories
    where the step's HLO was not at hand."""
    traced, stages = len(PROFILED_STEPS), profile.get("stages") or []
    if not stages:
        total = profile["total_ms"]
        return [
            (f"  {n}", f"{ms / traced:.1f} ms/step ({ms / total:.1%} of kernel time)")
            for n, ms in profile["categories"]
        ]
    step_ms = 1e3 * step_s
    busy = sum(p["busy_ms"] for p in profile["per_plane"]) / traced
    stages = [*stages, ("idle (step time with no kernel running)", max(0.0, step_ms - busy) * traced)]
    tflop, rate = profile.get("stage_tflop_per_step", {}), profile.get("matmul_tflops")
    rows = []
    for name, ms in stages:
        text = f"{ms / traced:.1f} ms/step ({ms / traced / step_ms:.1%} of the median step)"
        if name in tflop and ms:
            achieved = tflop[name] / (ms / traced / 1e3)
            text += f", {achieved:.3g} TFLOP/s" + (f" ({achieved / rate:.0%} of the BF16 matmul rate)" if rate else "")
        rows.append((f"  {name}", text))
    return rows


def _device_memory_gib(stat: str) -> float | None:
    """A memory statistic of the first local device (`peak_bytes_in_use`, `bytes_limit`); None on the CPU."""
    import jax

    value = (jax.local_devices()[0].memory_stats() or {}).get(stat)
    return None if value is None else value / 2**30


PROFILED_STEPS = (1, 2)  # warm-up steps after the compiling one: the timed steps stay untraced
# With --profile, one more untimed step: MaxText stops the profiler (and writes the trace) at the start of
# the step after the traced ones, which then took 27 s on an H200 (docs/PERFORMANCE.md).


def run(
    resolved: ResolvedRecipe, *, steps: int, warmup: int, profile: bool = False, out: Callable[[str], None] = print
) -> BenchResult | None:
    """Train `warmup + steps` steps of `resolved` in a fresh run folder and summarise the timed ones;
    with `profile`, MaxText traces warm-up steps 1-2 and the summary says where their device time went.

    Returns None in every process but the first of a multi-process run.
    """
    from maxtext_moe import plan
    from maxtext_moe.plan import flops as plan_flops

    if steps < 2 or warmup < 1:
        raise UserError(
            f"needs at least 1 warm-up and 2 timed steps, got {warmup} and {steps}.",
            fix="use --warmup 1 or more and --steps 2 or more.",
        )
    if profile and warmup <= PROFILED_STEPS[-1]:
        raise UserError(
            f"--profile traces warm-up steps {PROFILED_STEPS[0]}-{PROFILED_STEPS[-1]}, so it needs "
            f"{PROFILED_STEPS[-1] + 1} or more warm-up steps, got {warmup}.",
            fix="use --warmup 3 or more.",
        )
    warmup += 1 if profile else 0
    total = warmup + steps
    traced = (
        dict(profiler="xplane", skip_first_n_steps_for_profiler=PROFILED_STEPS[0], profiler_steps=len(PROFILED_STEPS))
        if profile
        else {}
    )
    # No checkpoints, so every bench starts at step 0 and MaxText restarts the metrics file; the name has
    # no time stamp because every process of a multi-process run must arrive at the same folder.
    maxtext = dict(
        resolved.maxtext,
        steps=total,
        learning_rate_schedule_steps=total,
        enable_checkpointing=False,
        save_checkpoint_on_completion=False,
        run_name=f"{resolved.maxtext.get('run_name') or resolved.name}-bench",
        **traced,
    )
    # MaxText's own schedule over the bench's steps, not the training section's: its warm-up (2,000 steps in
    # DeepSeek-V3's) would hold the learning rate near 0 over a few steps, and a bench needs a falling loss. The
    # step is the same: the section's gradient accumulation stays in `maxtext`.
    bench_recipe = dataclasses.replace(resolved, maxtext=maxtext, training=None)
    if profile:  # the step's optimized HLO, for the profile's split by stage (tools/profile.py)
        hlo = train.run_paths(bench_recipe).run / "hlo"
        dump = f"--xla_dump_to={hlo} --xla_dump_hlo_module_re=jit_train_step --xla_dump_hlo_as_text"
        flags = f"{resolved.env.get('XLA_FLAGS', '')} {dump}".strip()
        bench_recipe = dataclasses.replace(bench_recipe, env={**resolved.env, "XLA_FLAGS": flags})
    hw = resolved.topology.profile
    # The planner's step time needs a device peak; on the CPU only its FLOPs count applies.
    predicted = plan.estimate(bench_recipe) if hw.peak_bf16_tflops else None
    flops = plan_flops.per_token(plan.Model.from_recipe(bench_recipe), int(bench_recipe.effective("max_target_length")))
    train.train(bench_recipe, out=out, count_upstream_routing=False)
    import jax

    if jax.process_index() != 0:  # one process writes the metrics file and reports (multi-process runs)
        return None
    metrics = read_metrics(train.run_paths(bench_recipe).metrics)
    timed = [metrics[s] for s in range(warmup, total) if s in metrics]
    if len(timed) != steps:
        raise UserError(
            f"MaxText reported {len(timed)} of the {steps} timed steps.",
            fix=f"see {train.run_paths(bench_recipe).log}.",
        )
    times = [m["perf/step_time_seconds"] for m in timed]
    losses = [m["learning/loss"] for m in timed]
    half = len(losses) // 2
    learning = all(math.isfinite(v) for v in losses) and statistics.mean(losses[half:]) < statistics.mean(losses[:half])
    median = statistics.median(times)
    devices = resolved.topology.num_devices
    tokens = int(round(timed[0]["perf/per_device_tokens"] * devices))
    gflops = flops.total / 1e9
    tflops = gflops * 1e9 * tokens / median / devices / 1e12
    fp8 = any("fp8" in str(resolved.effective(k) or "") for k in FP8_KEYS) or resolved.moe_settings.expert_fp8
    return BenchResult(
        recipe=resolved.name,
        hardware=hw.name,
        devices=devices,
        warmup_steps=warmup,
        timed_steps=steps,
        step_s_median=median,
        step_s_min=min(times),
        step_s_max=max(times),
        tokens_per_step=tokens,
        tokens_per_s_per_gpu=tokens / median / devices,
        gflops_per_token=gflops,
        mtp_layers=int(resolved.effective("mtp_num_layers") or 0),
        model_tflops_per_gpu=tflops,
        maxtext_tflops_per_gpu=statistics.median(m["perf/per_device_tflops_per_sec"] for m in timed),
        mfu_bf16=tflops / hw.peak_bf16_tflops if hw.peak_bf16_tflops else None,
        mfu_fp8=tflops / hw.peak_fp8_tflops if fp8 and hw.peak_fp8_tflops else None,
        peak_device_memory_gib=_device_memory_gib("peak_bytes_in_use"),
        host_peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        predicted_step_s=predicted.step_s if predicted else None,
        loss_first=losses[0],
        loss_last=losses[-1],
        losses=losses,
        loss_finite_and_falling=learning,
        date=time.strftime("%Y-%m-%d"),
        settings=maxtext,
        moe=resolved.moe,
        attention=resolved.attention,
        profile=_profile(bench_recipe, flops, tokens / devices) if profile else None,
        device_memory_limit_gib=_device_memory_gib("bytes_limit"),
        env=dict(resolved.env),
        routing_weights="before wo" if resolved.moe_settings.ours else "after wo",
    )


def _profile(bench_recipe: ResolvedRecipe, flops: Flops, tokens_per_gpu: float) -> dict[str, Any]:
    """The trace's summary, with the model FLOPs of each GEMM stage per GPU and step (the planner's
    convention: recomputation not counted) and the matmul rate to hold their achieved rates against."""
    from maxtext_moe.plan.estimate import DENSE_GEMM_EFFICIENCY

    run = train.run_paths(bench_recipe).run
    summary = traces.summarize(traces.find_trace(run), top=25, hlo=traces.find_hlo(run))
    per_step = {
        "expert GEMMs": flops.grouped_gemm,
        "dense GEMMs": flops.gemm,
        "attention forward": flops.core / 3,  # the backward pass does twice the forward's work
        "attention backward": 2 * flops.core / 3,
    }
    peak = bench_recipe.topology.profile.peak_bf16_tflops
    summary["stage_tflop_per_step"] = {k: v * tokens_per_gpu / 1e12 for k, v in per_step.items()}
    summary["matmul_tflops"] = DENSE_GEMM_EFFICIENCY * peak if peak else None
    return summary


def write_json(result: BenchResult, path: Path) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(), indent=1, default=str))
