"""What XLA scheduled inside each all-to-all of a compiled step, read from its HLO dump.

The gap: XLA:GPU runs an all-to-all asynchronously (a start and a done) and its latency-hiding scheduler
decides what runs between the two; neither `memory_analysis()` nor a one-GPU profile shows it, and a
two-GPU machine to profile EP on is not always at hand. An expert-parallel exchange with a GEMM scheduled
inside it can hide behind that GEMM; one with nothing but small fusions inside is exposed. The optimized module
XLA dumps (`xla_dump_to`, as text) lists each scheduled computation's instructions in schedule order: the entry
computation, and the bodies of its while loops, where scanned layers (and gradient accumulation) put theirs.

    maxtext-moe plan RECIPE --compile xla_flags.xla_dump_to=DIR xla_flags.xla_dump_hlo_as_text=true \\
        xla_flags.xla_dump_hlo_module_re=jit_train_step
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.plan.hlo_text import BODY, CALLS, INSTRUCTION, computations, read_optimized

_ALL_TO_ALL = re.compile(r" all-to-all\(")
_GROUPED_GEMM = 'custom_call_target="te_grouped_gemm_ffi"'
# cuBLAS GEMMs as custom calls, or as XLA's GEMM fusions (`gemm_fusion_dot...`, kind kCustom).
_DENSE_GEMM = re.compile(r'custom_call_target="__cublas|kind=kCustom, calls=%gemm_fusion')


@dataclass(frozen=True)
class Window:
    """One asynchronous all-to-all: what XLA scheduled between its start and its done."""

    instructions: int
    dense_gemms: int
    grouped_gemms: int
    in_loop: bool = False  # in a while loop's body: once an iteration (a scanned layer's exchange)

    @property
    def has_gemm(self) -> bool:
        return bool(self.dense_gemms or self.grouped_gemms)


@dataclass(frozen=True)
class ExchangeOverlap:
    windows: list[Window]  # asynchronous all-to-alls, in schedule order
    synchronous: int  # all-to-alls run in place, with nothing beside them (XLA:CPU runs every one so)

    def render(self) -> str:
        total = len(self.windows) + self.synchronous
        with_gemm = [w for w in self.windows if w.has_gemm]
        looped = sum(1 for w in self.windows if w.in_loop)
        where = f"'s code ({looped} in loop bodies, run once an iteration)" if looped else ""
        return (
            f"all-to-all: {total} in the step{where}, {len(self.windows)} asynchronous; {len(with_gemm)} with a GEMM "
            f"scheduled inside ({sum(1 for w in with_gemm if w.dense_gemms)} a dense GEMM, "
            f"{sum(1 for w in with_gemm if w.grouped_gemms)} a TE grouped GEMM), "
            f"{total - len(with_gemm)} with none (exposed unless other work hides them)"
        )

    def to_json(self) -> dict[str, Any]:
        return {"synchronous": self.synchronous, "windows": [asdict(w) for w in self.windows]}


def read(hlo: str) -> ExchangeOverlap | None:
    """The all-to-alls of an optimized module's entry computation and of its while loops' bodies; None when it
    has none."""
    entry, by_name = computations(hlo)
    exchanges = {name for name, c in by_name.items() if _ALL_TO_ALL.search(c)}
    bodies = set(BODY.findall(hlo))
    windows: list[Window] = []
    synchronous = 0
    for computation in [entry, *(c for name, c in by_name.items() if name in bodies)]:
        found, sync = _scheduled(computation.split("\n"), exchanges, in_loop=computation is not entry)
        windows += found
        synchronous += sync
    if not windows and not synchronous:
        return None
    return ExchangeOverlap(windows, synchronous)


def _scheduled(lines: list[str], exchanges: set[str], in_loop: bool) -> tuple[list[Window], int]:
    """The asynchronous all-to-alls of one computation's schedule, and how many ran in place."""
    started: dict[str, int] = {}
    windows, synchronous = [], 0
    for i, line in enumerate(lines):
        name = INSTRUCTION.match(line)
        if name is None:
            continue
        calls = CALLS.search(line)
        if " async-start(" in line and calls and calls.group(1) in exchanges:
            started[name.group(1)] = i
        elif " async-done(" in line:
            start = next((s for n, s in started.items() if re.search(rf"{re.escape(n)}\b", line)), None)
            if start is not None:
                inside = lines[start + 1 : i]
                windows.append(
                    Window(
                        instructions=sum(1 for x in inside if INSTRUCTION.match(x)),
                        dense_gemms=sum(1 for x in inside if _DENSE_GEMM.search(x)),
                        grouped_gemms=sum(1 for x in inside if _GROUPED_GEMM in x),
                        in_loop=in_loop,
                    )
                )
        elif _ALL_TO_ALL.search(line):
            synchronous += 1
    return windows, synchronous


def find(dump_dir: Path, module: str = "jit_train_step") -> ExchangeOverlap | None:
    """`read` of the largest optimized module named `module` that XLA dumped in `dump_dir`."""
    return read(read_optimized(dump_dir, module))
