"""The memory XLA:GPU's scheduler lets a compiled step use, to read `plan --compile`'s total against.

The gap: `compiled.memory_analysis()` gives the temporaries XLA allocated, not the budget it scheduled them
to. XLA:GPU gives its latency-hiding scheduler 80% of the device's memory, less the step's arguments and
outputs (a donated one counted once), times `--xla_gpu_memory_limit_slop_factor` percent (95 unless set):
`GetSchedulerMemoryLimit` in XLA's `gpu_hlo_schedule.cc`. Within that budget the scheduler starts
collectives early and keeps their buffers, so on a GPU with memory to spare a compile's total says what XLA
chose to hold for overlap, not what the step needs: the 671B GB200 and GB300 recipes compiled to their
budgets, whatever their depth (docs/PLAN.md). This module computes the budget by the same rule, says where a
compile sits against it, and gives the slop factor that asks XLA to keep a step within a planned total.

Above the budget XLA recomputes values rather than keep them (`remat_gemms` counts the GEMM work). When the
process lets XLA's allocator take more than the 80% the rule assumes (`XLA_PYTHON_CLIENT_MEM_FRACTION`: the
one-GPU FP8 proxy runs at 0.96), a larger slop factor fits that memory; the verdict names the largest.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

GIB = 2**30
BASE_FRACTION = 0.8  # of the device's memory, left after what XLA's allocator does not see
ALLOCATOR_FRACTION = 0.75  # JAX's XLA_PYTHON_CLIENT_MEM_FRACTION when unset
DEFAULT_SLOP_PERCENT = 95
# Temporaries within this fraction of the budget (below or above) mean the scheduler, not the step, set them.
AT_BUDGET = 0.05
_SLOP = re.compile(r"--xla_gpu_memory_limit_slop_factor=(\d+)")


def slop_percent(xla_flags: str) -> int:
    """The slop factor an `XLA_FLAGS` string sets (the last one wins, as in XLA's flag parser), else XLA's."""
    found = _SLOP.findall(xla_flags)
    return int(found[-1]) if found else DEFAULT_SLOP_PERCENT


@dataclass(frozen=True)
class SchedulerLimit:
    device_memory: int  # bytes, as XLA sees the device (the driver's figure)
    io_bytes: int  # arguments + outputs - donated (aliased): live for the whole step
    slop_percent: int
    temp_bytes: int  # the temporaries XLA allocated
    allocator_fraction: float = ALLOCATOR_FRACTION  # of the device's memory XLA's allocator may take

    @property
    def base(self) -> float:
        return BASE_FRACTION * self.device_memory - self.io_bytes

    @property
    def temp_budget(self) -> float:
        return self.base * self.slop_percent / 100

    @property
    def used(self) -> float:
        """Temporaries over the budget; infinite where the step's I/O alone leaves XLA no budget (XLA: 0)."""
        return self.temp_bytes / self.temp_budget if self.temp_budget > 0 else math.inf

    def slop_for(self, total_bytes: float) -> int:
        """The smallest slop factor whose budget lets the step's total (I/O + temporaries) reach `total_bytes`."""
        if self.base <= 0:
            return 100
        return max(1, min(100, math.ceil(100 * (total_bytes - self.io_bytes) / self.base)))

    def slop_for_allocator(self) -> int:
        """The largest slop factor whose budget, with the step's I/O, stays within the allocator's memory."""
        if self.base <= 0:
            return self.slop_percent
        return math.floor(100 * (self.allocator_fraction * self.device_memory - self.io_bytes) / self.base)

    def verdict(self, planned_total: float) -> str:
        """Whether the temporaries were the step's need or the scheduler's choice, for a user to act on."""
        if self.used > 1 + AT_BUDGET:
            room = self.slop_for_allocator()
            return "above it: XLA could not schedule the step within its budget, so the step needs this much" + (
                f"; the allocator's {self.allocator_fraction:.0%} of the GPU has room for a budget up to "
                f"xla_flags.xla_gpu_memory_limit_slop_factor={room}, with which XLA recomputes less to fit"
                if room > self.slop_percent
                else ""
            )
        if self.used >= 1 - AT_BUDGET and planned_total < self.io_bytes + self.temp_bytes:
            return (
                "at it: the scheduler spent its budget holding buffers early for overlap, so the total is XLA's "
                "choice, not the step's floor; to see whether the step keeps to the plan, compile it with "
                f"xla_flags.xla_gpu_memory_limit_slop_factor={self.slop_for(planned_total)}"
            )
        return "within it: the total is what the step needs as XLA scheduled it"

    def render(self, planned_total: float) -> str:
        return (
            f"XLA's scheduler budget for temporaries: {self.temp_budget / GIB:.1f} GiB ({BASE_FRACTION:.0%} of "
            f"{self.device_memory / GIB:.1f} GiB less {self.io_bytes / GIB:.1f} GiB of arguments and outputs, "
            f"x {self.slop_percent}%); temporaries {self.temp_bytes / GIB:.1f} GiB = {self.used:.0%}, "
            + self.verdict(planned_total)
        )

    def to_json(self, planned_total: float) -> dict[str, Any]:
        return {
            "device_memory_bytes": self.device_memory,
            "io_bytes": self.io_bytes,
            "slop_percent": self.slop_percent,
            "temp_budget_bytes": int(self.temp_budget),
            "temp_over_budget": self.used,
            "slop_percent_for_plan": self.slop_for(planned_total),
            "allocator_fraction": self.allocator_fraction,
            "slop_percent_for_allocator": self.slop_for_allocator(),
            "verdict": self.verdict(planned_total),
        }


def of(
    mem: dict[str, int], device_memory: int, xla_flags: str, allocator_fraction: float = ALLOCATOR_FRACTION
) -> SchedulerLimit:
    """The budget of a step whose `memory_analysis()` fields are `mem`, on a device of `device_memory` bytes."""
    io = mem.get("argument_size", 0) + mem.get("output_size", 0) - mem.get("alias_size", 0)
    return SchedulerLimit(device_memory, io, slop_percent(xla_flags), mem.get("temp_size", 0), allocator_fraction)
