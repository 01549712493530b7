"""What XLA keeps alive at a compiled program's memory peak, read from its HLO dump.

Why: `compiled.memory_analysis()` gives totals only. When a compile does not fit, the question is which
buffers are alive together at the peak and which JAX operation made them. XLA writes the peak's buffers
when it dumps the optimized module (`xla_dump_to`): the live-range file lists them with their sizes, the
buffer assignment has their shapes and the HLO their JAX op names. This joins the three and groups the
peak's buffers by shape and op name, largest first. Reading the dumps this way found both causes of the
671B compile's excess (docs/PLAN.md, "Compiled vs planned").

    maxtext-moe plan RECIPE --compile xla_flags.xla_dump_to=DIR xla_flags.xla_dump_hlo_as_text=true \\
        xla_flags.xla_dump_hlo_module_re=jit_train_step
    python -m maxtext_moe.plan.peak DIR
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.plan.hlo_text import reader_main

GIB = 2**30
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=\d+,offset=\d+\): (\S+?)(?:\{[\d,]*\})?$", re.M)
_PEAK = re.compile(r"Live ranges at (\d+) \(peak\):\n((?:    \S+: \d+ bytes.*\n?)+)")
_PEAK_VALUE = re.compile(r"^    (\S+): (\d+) bytes", re.M)
_POSITION = re.compile(r"^\s+(\d+):(\S+)$", re.M)
_OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"", re.M)


@dataclass(frozen=True)
class Group:
    """Values alive at the peak with the same shape, made by the same JAX operation."""

    shape: str
    op_name: str
    count: int
    bytes: int


@dataclass(frozen=True)
class Peak:
    position: int  # in XLA's schedule of the entry computation
    instruction: str  # the instruction scheduled there
    of: int  # instructions in the schedule
    bytes: int  # alive there, in all
    groups: list[Group]  # largest first

    def render(self, top: int = 20) -> str:
        lines = [
            f"peak: {self.bytes / GIB:.2f} GiB alive at {self.position} of {self.of} in XLA's schedule "
            f"({self.instruction})"
        ]
        for g in self.groups[:top]:
            op = g.op_name if len(g.op_name) <= 110 else g.op_name[:60] + " ... " + g.op_name[-45:]
            lines.append(f"{g.bytes / GIB:7.2f} GiB {g.count:4d} x {g.shape:30s} {op}")
        if len(self.groups) > top:
            lines.append(f"... {len(self.groups) - top} more groups")
        return "\n".join(lines)


def _dump_files(dump_dir: Path, module: str) -> tuple[str, str, str]:
    """The buffer assignment, live ranges and optimized HLO of the largest dumped module named `module`."""
    pattern = f"*{module}*after_optimizations-buffer-assignment.txt"
    found = sorted(dump_dir.glob(pattern), key=lambda p: p.stat().st_size)
    if not found:
        raise UserError(
            f"no buffer assignment of {module!r} in {dump_dir} (`{pattern}`).",
            fix="compile for GPUs with xla_flags.xla_dump_to=DIR xla_flags.xla_dump_hlo_as_text=true "
            f"(xla_flags.xla_dump_hlo_module_re={module} keeps the dump small); plan --compile's CPU route "
            "writes no buffer assignment of MaxText's step.",
        )
    stem = str(found[-1]).removesuffix("-buffer-assignment.txt")
    texts = []
    for suffix in ("-buffer-assignment.txt", "-live-range.txt", ".txt"):
        path = Path(stem + suffix)
        if not path.is_file():
            raise UserError(f"{path} is missing from the dump.", fix="dump the HLO as text (xla_dump_hlo_as_text).")
        texts.append(path.read_text())
    return texts[0], texts[1], texts[2]


def find_peak(dump_dir: Path, module: str = "jit_train_step") -> Peak:
    """The buffers alive at the peak XLA found in its schedule of `module`, grouped by shape and op name."""
    assignment, live_ranges, hlo = _dump_files(dump_dir, module)
    peak = _PEAK.search(live_ranges)
    if peak is None:
        raise UserError(f"the live-range dump of {module!r} in {dump_dir} names no peak.", fix="dump it again.")
    at = int(peak.group(1))
    shapes = {}
    for m in _VALUE.finditer(assignment):
        name = m.group(1)
        shapes[name if name.endswith("}") else name + "{}"] = m.group(2)
    schedule = dict((int(m.group(1)), m.group(2)) for m in _POSITION.finditer(live_ranges.split("BufferLiveRange")[0]))
    op_names = {}
    for m in _OP_NAME.finditer(hlo):
        op_names.setdefault(m.group(1), re.sub(r"^jit\([^)]*\)/", "", m.group(2)))
    grouped: dict[tuple[str, str], list[int]] = defaultdict(list)
    for m in _PEAK_VALUE.finditer(peak.group(2)):
        name, size = m.group(1), int(m.group(2))
        grouped[(shapes.get(name, "?"), op_names.get(name.split("{")[0], "?"))].append(size)
    groups = sorted(
        (Group(shape, op, len(sizes), sum(sizes)) for (shape, op), sizes in grouped.items()), key=lambda g: -g.bytes
    )
    return Peak(at, schedule.get(at, "?"), len(schedule), sum(g.bytes for g in groups), groups)


def main(argv: list[str] | None = None) -> int:
    return reader_main("python -m maxtext_moe.plan.peak", __doc__, find_peak, argv, "groups", 20)


if __name__ == "__main__":
    sys.exit(main())
