"""The remat names our block gives its expert GEMM outputs, shared by the layer that tags them and the planner
that reads where a policy places them.

MaxText's policies are lists of names (`remat_policy: minimal` saves `mlpwi_0`, `mlpwi_1` and `mlpwo`; a
custom policy also takes the MoE-only `moe_mlpwi_0`, `moe_mlpwi_1`, `moe_mlpwo`), so each output carries both
families, as MaxText's own `sparse_matmul` path tags them. wi_0 and wi_1 run as one grouped GEMM, whose output
is tagged once with all four up-projection names: a policy keeps it whole or recomputes it whole, and two
halves saved apart would be copied out of it every step. JAX keeps a value tagged by a chain of names at the
outermost name its policy does not recompute, so the MoE-only names, applied last, decide over MaxText's
shared ones (which also name the dense MLPs).
"""

from __future__ import annotations

from collections.abc import Mapping

UP_OUTPUT = ("mlpwi_0", "mlpwi_1", "moe_mlpwi_0", "moe_mlpwi_1")  # innermost first
WO_OUTPUT = ("mlpwo", "moe_mlpwo")


def up_output_placement(placements: Mapping[str, str]) -> str:
    """Where the wi_0/wi_1 GEMM's output lives under a policy that places each name (`device`, `offload` or
    `remat`): at its outermost name's placement that is not `remat`."""
    return next((placements[n] for n in reversed(UP_OUTPUT) if placements[n] != "remat"), "remat")
