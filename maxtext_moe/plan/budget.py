"""How long a recipe's token budget takes at the planned step time, beside what DeepSeek-V3 itself cost.

The step time is the plan's (`estimate.Plan.step_s`, calibrated against measured steps); the steps are the
`training:` section's (`recipe/timeline.py`). Every step computes the section's `batch_end` sequences, the ramp's
masked ones included, so the time is the computed tokens over the planned throughput. DeepSeek-V3's figures are
from its report (arXiv 2412.19437, table 1 and sec. 3.1): 2.788M H800 GPU-hours in all, of which 2.664M for the
14.8T-token pre-training, on 2,048 H800s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maxtext_moe.plan.estimate import Plan
from maxtext_moe.recipe.training import TrainingSettings, tokens_text

DEEPSEEK_V3_GPU_HOURS = 2.788e6  # H800: pre-training, context extension and post-training
DEEPSEEK_V3_PRETRAIN_GPU_HOURS = 2.664e6  # H800: the 14.8T-token pre-training alone
DEEPSEEK_V3_GPUS = 2048


@dataclass(frozen=True)
class Budget:
    tokens: float  # the budget: tokens trained
    computed_tokens: float  # tokens the steps compute, the ramp's masked sequences included
    steps: int
    seconds: float
    gpus: int
    hardware: str
    run_steps: int  # MaxText's steps: fewer than `steps` when the run stops early (a smoke run)
    step_s: float

    @property
    def days(self) -> float:
        return self.seconds / 86400

    @property
    def gpu_hours(self) -> float:
        return self.seconds * self.gpus / 3600

    def to_json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "computed_tokens": self.computed_tokens,
            "steps": self.steps,
            "days": self.days,
            "gpu_hours": self.gpu_hours,
            "deepseek_v3_h800_gpu_hours": DEEPSEEK_V3_GPU_HOURS,
            "deepseek_v3_pretraining_h800_gpu_hours": DEEPSEEK_V3_PRETRAIN_GPU_HOURS,
        }

    def render(self) -> str:
        extra = self.computed_tokens / self.tokens - 1
        return "\n".join(
            [
                f"  budget: {tokens_text(self.tokens)} tokens (training section) in {self.steps:,} steps"
                + (f", {extra:.1%} more computed (the batch ramp's mask)" if extra > 0.0005 else "")
                + f" -> {self.days:,.1f} days on {self.gpus} {self.hardware}, {self.gpu_hours / 1e6:.3f}M GPU-hours",
                f"    DeepSeek-V3 for reference: {DEEPSEEK_V3_GPU_HOURS / 1e6:.3f}M H800 GPU-hours in all, "
                f"{DEEPSEEK_V3_PRETRAIN_GPU_HOURS / 1e6:.3f}M for its 14.8T-token pre-training on "
                f"{DEEPSEEK_V3_GPUS:,} H800s ({DEEPSEEK_V3_PRETRAIN_GPU_HOURS / DEEPSEEK_V3_GPUS / 24:.0f} days)",
            ]
            + (
                [f"    this run stops after {self.run_steps} steps: {self.run_steps * self.step_s / 3600:.2f} h"]
                if self.run_steps < self.steps
                else []
            )
        )


def of(plan: Plan, settings: TrainingSettings, run_steps: int) -> Budget:
    """The budget of `settings` at `plan`'s throughput (tokens a step over its time, on all its GPUs); `run_steps`
    is MaxText's `steps`, where this run stops."""
    line = settings.timeline()
    computed = float(line.steps * settings.batch_end * settings.seq_len)
    lay = plan.layout
    tokens_per_s = lay.tokens * lay.devices / plan.step_s
    return Budget(
        tokens=line.tokens_at(line.steps),
        computed_tokens=computed,
        steps=line.steps,
        seconds=computed / tokens_per_s,
        gpus=lay.devices,
        hardware=lay.hardware.name,
        run_steps=run_steps,
        step_s=plan.step_s,
    )
