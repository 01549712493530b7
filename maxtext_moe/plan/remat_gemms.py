"""The GEMM work XLA recomputes to fit a step in memory, read from the compiled step's HLO dump.

The gap: when a step's buffers would exceed the device's memory, XLA's HLO rematerialization pass recomputes
values instead of keeping them (instructions named `*.remat`, `*.remat2`, ...). Neither `memory_analysis()`,
nor MaxText's TFLOPS (model FLOPs), nor the plan shows that work; a profile shows it only as kernels with
`remat` in their names. Compiled to 80% of an H200 (XLA's budget when no memory size is passed), the FP8
one-H200 proxy recomputed its LM heads' GEMMs several times a step; compiled to its allocator's limit, as a run
is, it recomputes none on the H200 and 7.7 of 166 TFLOP deviceless. This sums XLA's own GEMMs (`dot`
instructions, inside GEMM fusions too, and the cuBLAS calls an autotuned compile makes of them; TE's GEMMs are
custom calls of its own and not counted) over the schedule, while-loop bodies times their known trip count, and
the share under a rematerialized instruction. It reads the same dump as `exchange_overlap` (docs/PLAN.md gives
the flags).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxtext_moe.plan.hlo_text import CALLS, computations, loop_body, read_optimized

_SHAPE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%([\w.\-]+)")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
# An autotuned compile (a run on the GPU) hands most GEMMs to cuBLAS: a custom call whose result is a tuple of the
# product and a workspace, with the dot's dimension numbers in its backend config.
_CUBLAS = re.compile(r'= \(?\w+\[([\d,]*)\][^=]*? custom-call\(%([\w.\-]+).*custom_call_target="__cublas\$')
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
# The two forms a GEMM takes in the text: (output shape and left operand, its contracted dimensions).
_GEMM_FORMS = ((_DOT, _CONTRACTING), (_CUBLAS, _CUBLAS_CONTRACTING))
_REMAT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]*\.remat\d*(?:\.\d+)? = ")


def _gemm(line: str) -> tuple[list[int], str, list[int]] | None:
    """A GEMM instruction's output shape, left operand and contracted dimensions of it; None for other lines."""
    for gemm, contracting in _GEMM_FORMS:
        if (found := gemm.search(line)) and (dims := contracting.search(line)):
            out = [int(d) for d in found.group(1).split(",") if d]
            return out, found.group(2), [int(d) for d in dims.group(1).replace('"', "").split(",") if d]
    return None


@dataclass(frozen=True)
class RematGemms:
    """XLA's GEMM FLOPs in one step, and the part of them rematerialization adds."""

    total_flops: float
    remat_flops: float
    by_shape: dict[str, float] = field(default_factory=dict)  # "out [M,N], K" -> recomputed FLOPs

    def to_json(self) -> dict[str, Any]:
        return {"xla_gemm_flops": self.total_flops, "remat_gemm_flops": self.remat_flops, "by_shape": self.by_shape}

    def render(self, top: int = 3) -> str:
        line = (
            f"XLA's own GEMMs (not TE's): {self.total_flops / 1e12:.1f} TFLOP a step, of which "
            f"{self.remat_flops / 1e12:.1f} recomputed by XLA's rematerialization to fit memory"
        )
        if self.remat_flops:
            biggest = sorted(self.by_shape.items(), key=lambda kv: -kv[1])[:top]
            line += " (largest: " + "; ".join(f"{k}: {v / 1e12:.1f}" for k, v in biggest) + ")"
        return line


def analyse(text: str) -> RematGemms:
    """Sum the GEMM FLOPs of one optimized HLO module (XLA's text dump), from its entry computation down."""
    entry, comps = computations(text)
    shapes = {
        m.group(1): [int(d) for d in m.group(3).split(",") if d]
        for line in text.splitlines()
        if (m := _SHAPE.match(line))
    }
    total, remat, by_shape = 0.0, 0.0, Counter()

    def walk(computation: str, times: float, recomputed: bool) -> None:
        nonlocal total, remat
        for line in computation.splitlines():
            again = recomputed or bool(_REMAT.match(line))
            if gemm := _gemm(line):
                out, operand, contracted = gemm
                lhs = shapes.get(operand, [])
                k = 1
                for d in contracted:
                    k *= lhs[d] if d < len(lhs) else 1
                flops = 2.0 * k * times
                for d in out:
                    flops *= d
                total += flops
                if again:
                    remat += flops
                    by_shape[f"[{','.join(map(str, out))}] K={k}"] += flops
            for called in CALLS.findall(line):
                walk(comps.get(called, ""), times, again)
            if loop := loop_body(line):
                walk(comps.get(loop[0], ""), times * loop[1], again)

    walk(entry, 1.0, False)
    return RematGemms(total, remat, dict(by_shape))


def find(dump: Path, module: str = "jit_train_step") -> RematGemms:
    """`analyse` the largest optimized module named `module` that XLA dumped in `dump`."""
    return analyse(read_optimized(dump, module))
