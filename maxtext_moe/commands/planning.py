"""`plan`, `doctor` and `launch`: whether a recipe fits and runs where it is meant to, before it does."""

from __future__ import annotations

import argparse
import json

from maxtext_moe.commands import resolve, split_recipe
from maxtext_moe.errors import UserError


def cmd_plan(a: argparse.Namespace) -> int:
    from maxtext_moe import plan

    resolved = resolve(a.recipe, a.overrides)
    if a.compile:
        if a.search or a.gpus or a.gpu_type:
            raise UserError(
                "--compile compiles the recipe's own topology; it does not take --search, --gpus or --gpu-type.",
                key="--compile",
                fix="set the layout with overrides instead, e.g. topology.nodes=16.",
            )
        from maxtext_moe.plan import compiled

        fit = compiled.run(a.recipe, a.overrides, resolved)
        print(json.dumps(fit.to_json(), indent=2) if a.json else fit.render())
        return 0
    if a.search:
        ranked = plan.search.rank(resolved, gpus=a.gpus, gpu_type=a.gpu_type)
        print(json.dumps([p.to_json() for p in ranked], indent=2) if a.json else plan.search.render(ranked))
        return 0
    result = plan.estimate(resolved, gpus=a.gpus, gpu_type=a.gpu_type)
    settings = resolved.training_settings
    cost = None if settings is None else plan.budget.of(result, settings, int(resolved.effective("steps")))
    if a.json:
        print(json.dumps(result.to_json() | ({"budget": cost.to_json()} if cost else {}), indent=2))
    else:
        print(result.render() + ("" if cost is None else "\n" + cost.render()))
    return 0


def cmd_doctor(a: argparse.Namespace) -> int:
    from maxtext_moe.tools import doctor

    ref, overrides = split_recipe(a.args)
    return doctor.run(resolve(ref, overrides), as_json=a.json)


def cmd_launch(a: argparse.Namespace) -> int:
    from maxtext_moe.tools import launch

    if a.k8s and (a.runtime != "pyxis" or a.venv):
        raise UserError(
            "--runtime and --venv are for --slurm: a Kubernetes pod runs the image's maxtext-moe.",
            key="--k8s",
            fix="leave them out with --k8s.",
        )
    resolved = resolve(a.recipe, [*a.overrides, f"topology.nodes={a.nodes * (a.tasks_per_node or 1)}"])
    if not a.skip_fit_check:
        launch.check_fits(resolved)
    text = launch.render(
        resolved,
        "slurm" if a.slurm else "k8s",
        image=a.image,
        time=a.time,
        runtime=a.runtime,
        venv=a.venv,
        max_restarts=a.max_restarts,
        tasks_per_node=a.tasks_per_node,
        warning_s=a.warning,
        overrides=a.overrides,
    )
    print(text, end="")
    return 0
