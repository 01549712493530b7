"""The memory XLA:GPU's scheduler lets a compiled step use, to read `plan --compile`'s total against.

The gap: `compiled.memory_analysis()` gives the temporaries XLA allocated, not the budget it scheduled them
to. XLA:GPU (`GetSchedulerMemoryLimit` in its `gpu_hlo_schedule.cc`) starts from the memory size the compile
was given, or, given none, 80% of the device's memory; subtracts the step's arguments and outputs (a donated
one counted once); and takes `--xla_gpu_memory_limit_slop_factor` percent (95 unless set) of the rest.
JAX gives it the limit of the process's GPU allocator: `XLA_PYTHON_CLIENT_MEM_FRACTION` of the device's
memory (0.75 unless set; no limit under `XLA_PYTHON_CLIENT_ALLOCATOR=platform`). `plan --compile` passes the
same limit to its deviceless compile (`upstream/deviceless.py`), so that both schedule to what a run has.

Within that budget the scheduler starts collectives early and keeps their buffers, so on a GPU with memory to
spare a compile's total says what XLA chose to hold for overlap, not what the step needs: the 671B GB200 and
GB300 recipes compiled to their budgets, whatever their depth (docs/PLAN.md). Above it XLA recomputes values
rather than keep them (`remat_gemms` counts the GEMM work). This module computes the budget by the same rule,
says where a compile sits against it and whether its total fits the allocator's limit, and gives the slop
factor that asks XLA to keep a step within a planned total, or within that limit.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

GIB = 2**30
UNPASSED_FRACTION = 0.8  # of the device's memory, XLA's base where the compile was given no memory size
JAX_MEM_FRACTION = 0.75  # JAX's XLA_PYTHON_CLIENT_MEM_FRACTION when unset
DEFAULT_SLOP_PERCENT = 95
# Temporaries within this fraction of the budget (below or above) mean the scheduler, not the step, set them.
AT_BUDGET = 0.05
# A GPU's own (autotuned) compile of each one-GPU proxy came up to 1.4 GiB above the deviceless one
# (docs/PERFORMANCE.md): a compiled total closer than this to the allocator's limit may not fit the run's.
FIRST_RUN_MARGIN = 2 * GIB
# Past its budget, XLA's temporaries shrink less than the budget does: 0.7-0.9% for each 1% of slop factor on the
# H100-256 and H200-128 recipes (slop 95 -> 84 and 95 -> 88 -> 84, docs/results); the lower figure sizes a guess.
TEMP_PER_BUDGET = 0.7
_SLOP = re.compile(r"--xla_gpu_memory_limit_slop_factor=(\d+)")


def slop_percent(xla_flags: str) -> int:
    """The slop factor an `XLA_FLAGS` string sets (the last one wins, as in XLA's flag parser), else XLA's."""
    found = _SLOP.findall(xla_flags)
    return int(found[-1]) if found else DEFAULT_SLOP_PERCENT


def allocator_bytes(device_memory: int, env: Mapping[str, str]) -> int:
    """The limit of the GPU allocator JAX starts in a process with `env`, which JAX also gives XLA's compiler
    as the device's memory size; 0 where the allocator has none (`XLA_PYTHON_CLIENT_ALLOCATOR=platform`)."""
    if env.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 0
    return int(device_memory * float(env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_MEM_FRACTION)))


@dataclass(frozen=True)
class SchedulerLimit:
    device_memory: int  # bytes, as XLA sees the device (the driver's figure)
    io_bytes: int  # arguments + outputs - donated (aliased): live for the whole step
    slop_percent: int
    temp_bytes: int  # the temporaries XLA allocated
    passed_memory: int = 0  # the memory size the compile was given (the allocator's limit); 0 where none

    @property
    def base_memory(self) -> float:
        return self.passed_memory or UNPASSED_FRACTION * self.device_memory

    @property
    def base(self) -> float:
        return self.base_memory - self.io_bytes

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

    def verdict(self, planned_total: float) -> str:
        """Whether the temporaries were the step's need or the scheduler's choice, for a user to act on."""
        if self.used > 1 + AT_BUDGET:
            return (
                "above it: XLA could not schedule the step within its budget, so the step needs this much, "
                "after recomputing what its rematerialization chose to"
            )
        if self.used >= 1 - AT_BUDGET and planned_total < self.io_bytes + self.temp_bytes:
            slop = self.slop_for(planned_total)
            return (
                "at it: XLA scheduled the step to its budget (holding buffers early for overlap, or recomputing "
                "values to stay within it), so the total is XLA's choice, not the step's floor"
                + (
                    "; to see whether the step keeps to the plan, compile it with "
                    f"xla_flags.xla_gpu_memory_limit_slop_factor={slop}"
                    if slop < self.slop_percent
                    else ""
                )
            )
        return "within it: the total is what the step needs as XLA scheduled it"

    def fit(self, total_bytes: float) -> str:
        """Whether a step of `total_bytes` fits the allocator's memory with room for a GPU's own compile, and the
        budget to try where it does not; empty where the allocator has no limit."""
        if not self.passed_memory:
            return ""
        room = self.passed_memory - total_bytes
        held = f"{total_bytes / GIB:.1f} of the {self.passed_memory / GIB:.1f} GiB JAX's allocator may take"
        if room >= FIRST_RUN_MARGIN:
            return f"fits: {held}, {room / GIB:.1f} GiB to spare"
        # A first guess to compile: the temporaries' cut, scaled by how little they follow the budget.
        cut = (1 - (self.passed_memory - FIRST_RUN_MARGIN - self.io_bytes) / max(self.temp_bytes, 1)) / TEMP_PER_BUDGET
        guess = max(1, min(self.slop_percent - 1, math.floor(self.slop_percent * (1 - cut))))
        budget = f"xla_flags.xla_gpu_memory_limit_slop_factor={guess}, a first guess to compile again"
        if room < 0:
            return f"does not fit: {held}; lower XLA's scheduler budget ({budget}) or the batch"
        return (
            f"fits with {room / GIB:.1f} GiB to spare, close to the end: {held}, and a GPU's own compile came up to "
            f"1.4 GiB above a deviceless one; before a step has run, a smaller budget leaves more room ({budget})"
        )

    def _describe_base(self) -> str:
        if self.passed_memory:
            return (
                f"the allocator's {self.passed_memory / GIB:.1f} GiB "
                f"({self.passed_memory / self.device_memory:.0%} of {self.device_memory / GIB:.1f})"
            )
        return f"{UNPASSED_FRACTION:.0%} of {self.device_memory / GIB:.1f} GiB"

    def render(self, planned_total: float) -> str:
        return (
            f"XLA's scheduler budget for temporaries: {self.temp_budget / GIB:.1f} GiB ({self._describe_base()} "
            f"less {self.io_bytes / GIB:.1f} GiB of arguments and outputs, x {self.slop_percent}%); temporaries "
            f"{self.temp_bytes / GIB:.1f} GiB = {self.used:.0%}, " + self.verdict(planned_total)
        )

    def to_json(self, planned_total: float) -> dict[str, Any]:
        return {
            "device_memory_bytes": self.device_memory,
            "passed_memory_bytes": self.passed_memory,
            "io_bytes": self.io_bytes,
            "slop_percent": self.slop_percent,
            "temp_budget_bytes": int(self.temp_budget),
            "temp_over_budget": self.used,
            "slop_percent_for_plan": self.slop_for(planned_total),
            "verdict": self.verdict(planned_total),
        }


def of(mem: dict[str, int], device_memory: int, xla_flags: str, passed_memory: int = 0) -> SchedulerLimit:
    """The budget of a step whose `memory_analysis()` fields are `mem`, on a device of `device_memory` bytes,
    compiled with `passed_memory` as the device's memory size (0: none, as in a deviceless compile without it)."""
    io = mem.get("argument_size", 0) + mem.get("output_size", 0) - mem.get("alias_size", 0)
    return SchedulerLimit(device_memory, io, slop_percent(xla_flags), mem.get("temp_size", 0), passed_memory)
