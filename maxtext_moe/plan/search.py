"""Rank the layouts of a recipe that fit: FSDP x EP x PP, per-device batch, remat/offload policy.

Choosing a layout by hand means re-deriving memory and time for every mesh; MaxText can only try
one by compiling it on the real cluster. This enumerates the candidates the planner can price,
keeping EP inside one NVLink domain and dividing the experts, and PP dividing the MoE layers.
"""

from __future__ import annotations

from collections.abc import Iterator

from maxtext_moe.plan import layout as layout_mod
from maxtext_moe.plan.estimate import GIB, Plan, evaluate
from maxtext_moe.plan.layout import REMAT_TENSORS
from maxtext_moe.plan.model import Model
from maxtext_moe.recipe.resolved import ResolvedRecipe

BATCHES = (1, 2, 4, 6, 8)
PIPELINE_STAGES = (1, 2, 4, 8)
OFFLOAD_MOE_UP = {"moe_mlpwi_0": "offload", "moe_mlpwi_1": "offload"}
REMAT_CHOICES: dict[str, dict[str, str]] = {
    "full": {},
    "offload-moe-up": OFFLOAD_MOE_UP,
    "offload-moe-up-qv": OFFLOAD_MOE_UP | {"query_proj": "offload", "value_proj": "offload"},
}


def remat_policies() -> dict[str, dict[str, str]]:
    """The search's remat policies, each as where every named tensor lives (device, offload or remat)."""
    return {name: {t: choice.get(t, "remat") for t in REMAT_TENSORS} for name, choice in REMAT_CHOICES.items()}


def candidates(
    r: ResolvedRecipe,
    gpus: int | None = None,
    gpu_type: str | None = None,
    remat_choices: dict[str, dict[str, str]] | None = None,
) -> Iterator[Plan]:
    """Every layout of the search, fitting or not, each with its plan. `remat_choices` (name -> tensor ->
    device, offload or remat) replaces the search's own policies."""
    base = layout_mod.from_recipe(r, gpus, gpu_type)
    m = Model.from_recipe(r)
    groups, topk_groups = int(r.effective("n_routing_groups")), int(r.effective("topk_routing_group"))
    domain = min(base.hardware.nvlink_domain, base.devices)
    policies = remat_choices or remat_policies()
    for ep in (e for e in range(1, domain + 1) if m.experts % e == 0 and domain % e == 0):
        for pp in (p for p in PIPELINE_STAGES if m.moe_layers % p == 0):
            if base.devices % (ep * pp * base.tp * base.dp):
                continue
            fsdp = base.devices // (ep * pp * base.tp * base.dp)
            for batch in BATCHES:
                for name, policy in policies.items():
                    lay = base.replace(
                        ep=ep,
                        pp=pp,
                        fsdp=fsdp,
                        batch=float(batch),
                        remat_name=name,
                        microbatches=max(base.microbatches, 2 * pp) if pp > 1 else 1,
                        remat=policy,
                    )
                    yield evaluate(r.name, m, lay, groups, topk_groups)


def rank(r: ResolvedRecipe, gpus: int | None = None, gpu_type: str | None = None, top: int = 10) -> list[Plan]:
    """The `top` fitting layouts, fastest (TFLOPS/GPU) first."""
    fitting = [plan for plan in candidates(r, gpus, gpu_type) if plan.fits]
    return sorted(fitting, key=lambda p: -p.tflops_per_gpu)[:top]


def render(plans: list[Plan]) -> str:
    if not plans:
        return "no layout fits; try more GPUs (--gpus) or a GPU with more memory (--gpu-type)."
    lines = [f"{'TFLOPS/GPU':>10}  {'s/step':>7}  {'GiB/GPU':>7}  {'host GiB':>8}  layout"]
    for p in plans:
        lines.append(
            f"{p.tflops_per_gpu:>10,.0f}  {p.step_s:>7.2f}  {p.memory.device_total / GIB:>7.1f}  "
            f"{p.memory.host_total / GIB:>8.1f}  {p.layout.describe()}"
        )
    return "\n".join(lines)
