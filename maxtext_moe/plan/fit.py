"""What fits instead: the plan's verdict before a GPU run compiles, and the nearest layouts that fit once XLA has
run out of memory.

The gap: MaxText learns that a layout does not fit only when XLA allocates, after a compile of minutes (about two
for the one-GPU proxy at sequence 8192), and then stops with XLA's `RESOURCE_EXHAUSTED: Out of memory while
trying to allocate N GiB`, which names neither the cause nor a change that would fit. The planner prices a layout
in a millisecond without jax: `warning` says before the compile that the plan does not fit, and `out_of_memory`
turns XLA's error into the plan's figure and the nearest layouts of `plan --search` that fit, as overrides to
add. Each suggestion is composed and planned again as the user will run it (`maxtext-moe plan RECIPE ...
OVERRIDES` prints the same figure), so a recipe's own settings (`attention.residuals: save`, say) count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from maxtext_moe.errors import UserError
from maxtext_moe.plan import search
from maxtext_moe.plan.estimate import GIB, Plan, estimate
from maxtext_moe.plan.layout import Layout
from maxtext_moe.recipe import composition, validate
from maxtext_moe.recipe.resolved import ResolvedRecipe

# A run that ran out of memory at a layout the plan put within the GPU's memory: suggestions stay at least this
# far below the plan's figure for it (the plan is an estimate; docs/PLAN.md gives its measured error).
HEADROOM = 0.9
SUGGESTIONS = 3
# Suggestions are planned again from the recipe with their overrides, nearest first, until SUGGESTIONS are found.
MAX_TRIED = 12
# The memory fragment (configs/memory/NAME.yml, a `memory=NAME` override) for each remat policy of the search.
MEMORY_FRAGMENTS = {"full": "full-remat", "offload-moe-up": "offload-moe-up", "offload-moe-up-qv": "offload-moe-up-qv"}
MESH_KEYS = (("ep", "ici_expert_parallelism"), ("pp", "ici_pipeline_parallelism"), ("fsdp", "ici_fsdp_parallelism"))


@dataclass(frozen=True)
class Alternative:
    """Overrides that, added to the command, give a layout the planner puts within the GPU's memory."""

    overrides: tuple[str, ...]
    plan: Plan

    def render(self) -> str:
        mem = self.plan.memory.device_total / GIB
        return f"`{' '.join(self.overrides)}` ({mem:.1f} GiB, {self.plan.step_s:.2f} s/step)"


def _planned(r: ResolvedRecipe) -> Plan | None:
    """The plan of a GPU recipe; None on CPUs (the planner models GPU memory only) and for a recipe the planner
    cannot model (a remat policy or mesh axis it does not know): that is `plan`'s to say, not a run's to stop on."""
    if r.topology.profile.maxtext_hardware != "gpu":
        return None
    try:
        return estimate(r)
    except UserError:
        return None


def _figure(p: Plan) -> str:
    """The plan's memory per GPU against what is usable; host memory too when that is what does not fit."""
    lay, mem = p.layout, p.memory
    text = f"{mem.device_total / GIB:.1f} GiB per GPU of {lay.usable_gib:.1f} GiB usable on {lay.hardware.name}"
    if mem.host_total > lay.hardware.host_mem_gb * 1e9:
        text += f", {mem.host_total / GIB:.1f} GiB host memory per GPU of {lay.hardware.host_mem_gb:g} GB"
    return text


def _overrides(base: Layout, lay: Layout) -> tuple[str, ...]:
    """`key=value` overrides that turn the recipe's layout `base` into `lay`."""
    changes = [f"{key}={getattr(lay, axis)}" for axis, key in MESH_KEYS if getattr(lay, axis) != getattr(base, axis)]
    if lay.pp > 1 and lay.microbatches != base.microbatches:
        changes.append(f"num_pipeline_microbatches={lay.microbatches}")
    if lay.batch != base.batch:
        changes.append(f"per_device_batch_size={lay.batch:g}")
    if lay.remat != base.remat:
        changes.append(f"memory={MEMORY_FRAGMENTS[lay.remat_name]}")
    return tuple(changes)


def _nearness(base: Layout, changes: tuple[str, ...], p: Plan) -> tuple[float, ...]:
    """Fewest changes first; among them the batch kept (it sets what a step trains on), else the closest batch;
    then the fastest."""
    return (len(changes), abs(math.log2(p.layout.batch / base.batch)), -p.tflops_per_gpu)


def _varied(options: list[tuple[tuple[str, ...], Plan]]) -> list[tuple[tuple[str, ...], Plan]]:
    """The nearest option of each kind of change (the keys it sets) first, then the rest in order: three remat
    policies at one batch say less than one policy and one smaller batch."""
    kinds: dict[tuple[str, ...], int] = {}
    for i, (changes, _) in enumerate(options):
        kinds.setdefault(tuple(c.split("=", 1)[0] for c in changes), i)
    first = sorted(kinds.values())
    return [options[i] for i in first] + [o for i, o in enumerate(options) if i not in set(first)]


def nearest(ref: str, overrides: Sequence[str], r: ResolvedRecipe, limit_gib: float) -> list[Alternative]:
    """Layouts of the search that the planner puts within `limit_gib` per GPU (and the host's memory), nearest
    first (`_nearness`, `_varied`). The recipe's own remat policy is searched beside the search's."""
    base = estimate(r).layout
    policies = search.remat_policies() | {base.remat_name: base.remat}
    fitting = [
        (_overrides(base, p.layout), p)
        for p in search.candidates(r, remat_choices=policies)
        if p.fits and p.memory.device_total <= limit_gib * GIB
    ]
    fitting.sort(key=lambda c: _nearness(base, *c))
    found: list[Alternative] = []
    for changes, _ in _varied([c for c in fitting if c[0]])[:MAX_TRIED]:
        try:
            planned = estimate(validate.resolve(composition.compose(ref, [*overrides, *changes])))
        except UserError:  # a layout the recipe's checks refuse (a mesh that does not divide a weight, say)
            continue
        if planned.fits and planned.memory.device_total <= limit_gib * GIB:
            found.append(Alternative(changes, planned))
        if len(found) == SUGGESTIONS:
            break
    return found


def _suggest(alternatives: list[Alternative], ref: str) -> str:
    if not alternatives:
        return (
            f"no layout of `maxtext-moe plan {ref} --search` fits this many GPUs: use more (topology.nodes=N) or a "
            "GPU with more memory."
        )
    return "nearest layouts that fit, as overrides to add: " + "; ".join(a.render() for a in alternatives) + "."


def warning(ref: str, overrides: Sequence[str], r: ResolvedRecipe) -> str | None:
    """One line before a GPU run compiles when the plan says it does not fit; None when it fits, on CPUs, and
    where the planner cannot model the recipe."""
    planned = _planned(r)
    if planned is None or planned.fits:
        return None
    fitting = nearest(ref, overrides, r, planned.layout.usable_gib)
    return (
        f"warning: the planner puts {r.name} ({planned.layout.describe()}) at {_figure(planned)}: XLA will likely "
        f"run out of memory once it has compiled; {_suggest(fitting, ref)}"
    )


def out_of_memory(xla_message: str, ref: str, overrides: Sequence[str], r: ResolvedRecipe) -> UserError | None:
    """XLA's out-of-memory error of a run of `r` as one line: the plan's figure against the usable memory and the
    nearest layouts that fit, with room below the figure of the layout that failed. None where there is no plan
    (CPUs, a recipe the planner cannot model): the error then stays XLA's."""
    planned = _planned(r)
    if planned is None:
        return None
    limit = min(planned.layout.usable_gib, HEADROOM * planned.memory.device_total / GIB)
    verdict = "does not fit" if not planned.fits else "fits by the plan, which is an estimate (docs/PLAN.md)"
    return UserError(
        f"the GPU ran out of memory (XLA: {xla_message}); the planner puts {r.name} ({planned.layout.describe()}) "
        f"at {_figure(planned)}: it {verdict}.",
        fix=_suggest(nearest(ref, overrides, r, limit), ref),
    )
