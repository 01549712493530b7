"""The bytes a compiled step's memory-bound kernels move, read from its HLO dump.

The gap: a profile needs the GPU, and a change that adds a copy, a split or a cast pass to the step shows in the
optimized module before any GPU runs it. Each fusion or copy reads its operands and writes its result once;
this sums those bytes over the step's schedule (loop bodies times their known trip counts) for XLA's own
kernels that are not GEMMs, by the scope and operation each came from (the last two parts of its `op_name`, in
the forward pass, the backward pass or the step around them), and apart, for the FP8 casts TE runs as custom
calls (`*quantize*`). GEMMs, attention and collectives run at other limits and are left out. An upper bound:
an operand a fusion reads in part (a slice, a gather's rows) counts whole. It reads the same dump as
`remat_gemms` (docs/PLAN.md gives the flags):

    maxtext-moe plan RECIPE --compile xla_flags.xla_dump_to=DIR xla_flags.xla_dump_hlo_as_text=true \\
        xla_flags.xla_dump_hlo_module_re=jit_train_step
    python -m maxtext_moe.plan.memory_traffic DIR
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxtext_moe.plan.hlo_text import CALLS, computations, loop_body, read_optimized, reader_main

_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*?)\)(.*)$")
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_APPLIED = re.compile(r"to_apply=(%[\w.\-]+)")  # what a `call` instruction runs
_WRAPPERS = re.compile(r"\b(?:transpose|jvp|checkpoint|jit)\(|[()]")
# Instructions that move no data of their own, or not through HBM at a kernel's rate: bookkeeping, control flow,
# and communication.
_SKIP = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "partition-id",
        "replica-id",
        "all-reduce",
        "all-gather",
        "all-to-all",
        "reduce-scatter",
        "collective-permute",
        "ragged-all-to-all",
        "send",
        "recv",
        "send-done",
        "recv-done",
        "infeed",
        "outfeed",
        "opt-barrier",
        "dot",
        "convolution",
    }
)


def _bytes(shape: str) -> int:
    """Bytes of an HLO type: an array, or the arrays of a tuple."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            n *= int(d) if d else 1
        total += n * _width(dtype)
    return total


def _width(dtype: str) -> int:
    """Bytes of one element: 1 for pred and the FP8 types (f8e4m3fn, ...), else the bits in the name / 8."""
    return 1 if dtype == "pred" or dtype.startswith("f8") else max(1, int(dtype.lstrip("subf")) // 8)


def _elements(shape: str) -> list[str]:
    """The top-level members of a tuple type (one member for an array type)."""
    if not shape.startswith("("):
        return [shape]
    members, depth, part = [], 0, ""
    for ch in shape[1:-1]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            members.append(part)
            part = ""
        else:
            part += ch
    return [*members, part]


def _scope(op_name: str) -> str:
    """`pass scope/op` of an instruction's JAX op_name, transformation wrappers dropped; the pass is the
    forward, the backward, or the step around them (the optimizer update, the gradients' norm)."""
    direction = "backward" if "transpose(" in op_name else "forward" if "jvp(" in op_name else "step"
    parts = _WRAPPERS.sub("", op_name.removeprefix("jit(train_step)/")).split("/")
    parts = [p for p in parts if p and p not in ("checkpoint", "rematted_computation")]
    return f"{direction} {'/'.join(parts[-2:]) or 'unnamed'}"


@dataclass(frozen=True)
class MemoryTraffic:
    """Bytes moved in one step by XLA's memory-bound kernels and by TE's FP8 casts."""

    xla_bytes: float
    cast_bytes: float
    # "forward|backward|step scope/op" (or "unnamed OPCODE": XLA's own copies) -> XLA's bytes
    by_op: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"xla_bytes": self.xla_bytes, "fp8_cast_bytes": self.cast_bytes, "xla_bytes_by_op": self.by_op}

    def render(self, top: int = 4) -> str:
        biggest = sorted(self.by_op.items(), key=lambda kv: -kv[1])[:top]
        return (
            f"memory traffic outside GEMMs and attention: XLA's fusions and copies {self.xla_bytes / 1e9:.1f} GB a "
            f"step, TE's FP8 casts {self.cast_bytes / 1e9:.1f} GB (largest: "
            + "; ".join(f"{k} {v / 1e9:.1f}" for k, v in biggest)
            + ")"
        )


def analyse(text: str) -> MemoryTraffic:
    """Sum the bytes of one optimized HLO module (XLA's text dump), from its entry computation down."""
    entry, comps = computations(text)
    sizes: dict[str, int] = {}
    for line in text.splitlines():
        if found := _INSTRUCTION.match(line):
            name, shape = found.group(1), found.group(2)
            sizes[name] = _bytes(shape)
            for i, member in enumerate(_elements(shape)):
                sizes[f"{name}#{i}"] = _bytes(member)
    xla, cast, by_op = 0.0, 0.0, Counter()

    def walk(computation: str, times: float) -> None:
        nonlocal xla, cast
        for line in computation.splitlines():
            found = _INSTRUCTION.match(line)
            if not found:
                continue
            name, _, opcode, args, rest = found.groups()
            if loop := loop_body(line):
                walk(comps.get(loop[0], ""), times * loop[1])
            if opcode == "call":
                for called in _APPLIED.findall(rest):
                    walk(comps.get(called, ""), times)
            if opcode in _SKIP or opcode.endswith(("-start", "-done", "-update")):
                continue
            moved = times * (sizes[name] + sum(sizes.get(a, 0) for a in _OPERAND.findall(args)))
            if opcode == "custom-call":
                target = _TARGET.search(rest)
                cast += moved if target and "quantize" in target.group(1) else 0.0
                continue
            if opcode == "fusion" and any(" dot(" in comps.get(c, "") for c in CALLS.findall(rest)):
                continue  # a GEMM fusion
            xla += moved
            op_name = _OP_NAME.search(rest)
            by_op[_scope(op_name.group(1)) if op_name else f"unnamed {opcode}"] += moved

    walk(entry, 1.0)
    return MemoryTraffic(xla, cast, dict(by_op))


def find(dump: Path, module: str = "jit_train_step") -> MemoryTraffic:
    """`analyse` the largest optimized module named `module` that XLA dumped in `dump`."""
    return analyse(read_optimized(dump, module))


def main(argv: list[str] | None = None) -> int:
    return reader_main("python -m maxtext_moe.plan.memory_traffic", __doc__, find, argv, "operations", 10)


if __name__ == "__main__":
    sys.exit(main())
