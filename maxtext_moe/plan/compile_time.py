"""How long XLA takes to compile a recipe's training step: what the first step, and every restart that its
compile cache does not serve, waits before it trains.

Why: neither MaxText nor XLA says how long a compile will take, and for DeepSeek-V3 it ranges from under a
minute (scanned layers) to about an hour (unrolled), which decides how a team sets its SLURM time limits and
its restart budget. The figures are fitted to `maxtext-moe plan RECIPE --compile`, deviceless on a 2-core
x86 machine (docs/results/plan_compile_deviceless_671b_*.json, docs/PLAN.md "Compile time"):
- unrolled, XLA compiles each layer's own instructions, and its scheduling and buffer passes grow faster than
  the instruction count: the 61-layer steps took 34-53 minutes where 5 layers took 1-1.5;
- scanned, it compiles the loop body once, and the 671B steps took 36-43 s whatever the layout and batch (a
  model of a few layers compiles no slower unrolled, so the smaller of the two is taken).
Hopper targets compiled about 1.5x longer than Blackwell ones for the same unrolled step. On an H200 host (16
cores, JAX's mock topology) XLA compiled the scanned H200 step in 52 s, and the unrolled one was still compiling
after 1,110 s.
"""

from __future__ import annotations

from maxtext_moe.plan.layout import Layout
from maxtext_moe.plan.model import Model

# Unrolled: seconds = scale x layers ** exponent. The four 61-layer recipes, one accumulation step:
# H200 3,008 s and H100 3,160 s (6.3 and 6.6 x 61 ** 1.5), GB200 2,054 s and GB300 2,168 s (4.3 and 4.6).
UNROLLED_EXPONENT = 1.5
UNROLLED_SCALE = {9: 6.5, 10: 4.4}  # by the target's SM major version; others are priced as Hopper
# Scanned: the 671B steps' median (36-43 s over the four recipes, one accumulation step).
SCANNED_S = 40.0


def seconds(m: Model, lay: Layout, scanned: bool | None = None) -> float:
    """Expected deviceless compile time of `lay`'s step on a 2-core machine; `scanned` overrides the layout's."""
    major = lay.hardware.compute_capability[0] if lay.hardware.compute_capability else 9
    unrolled = UNROLLED_SCALE.get(major, UNROLLED_SCALE[9]) * m.layers**UNROLLED_EXPONENT
    return min(SCANNED_S, unrolled) if (lay.scanned if scanned is None else scanned) else unrolled


def render(m: Model, lay: Layout) -> str:
    """One line for `plan`: this layout's compile time, and the other layer layout's beside it."""
    other = "unrolled" if lay.scanned else "scanned"
    return (
        f"  compile: about {_minutes(seconds(m, lay))} deviceless on 2 CPU cores "
        f"({'scanned' if lay.scanned else 'unrolled'} layers; {other}: about "
        f"{_minutes(seconds(m, lay, not lay.scanned))}), paid again by every restart the compile cache misses"
    )


def _minutes(s: float) -> str:
    return f"{s:.0f} s" if s < 90 else f"{s / 60:.0f} min"
