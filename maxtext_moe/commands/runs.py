"""`train`, `bench`, `checkpoints` and `report`: a run of a recipe, and what its folder holds."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from maxtext_moe.commands import resolve, split_recipe
from maxtext_moe.errors import UserError
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.upstream import maxtext_errors


@contextmanager
def fit_checked(ref: str, overrides: Sequence[str], resolved: ResolvedRecipe, *, leader: bool) -> Iterator[None]:
    """The plan's verdict before a GPU run compiles (the `leader` process prints it), and XLA's out-of-memory
    error, which MaxText reports only after the compile, as the plan's figure and the layouts that fit
    (plan/fit.py)."""
    from maxtext_moe.plan import fit

    if leader and (line := fit.warning(ref, overrides, resolved)):
        print(f"maxtext-moe: {line}", file=sys.stderr)
    try:
        yield
    except Exception as e:
        found = maxtext_errors.out_of_memory(e)
        if found and (explained := fit.out_of_memory(found, ref, overrides, resolved)):
            raise explained from e
        raise


def cmd_train(a: argparse.Namespace) -> int:
    from maxtext_moe.run import distributed, task_supervisor, train

    ref, overrides = split_recipe(a.args)
    resolved = resolve(ref, overrides)
    spec = distributed.detect()
    if task_supervisor.wanted(spec.num_processes):  # this task's trainer runs as a child; see task_supervisor
        return task_supervisor.run(a.argv, train.run_paths(resolved).run, spec.process_id)
    try:
        with fit_checked(ref, overrides, resolved, leader=spec.process_id == 0):
            train.train(resolved, force=a.force, verbose=a.verbose)
    except train.Stopped as e:
        print(f"maxtext-moe: {e}", file=sys.stderr)
        return e.status  # 128 + the signal (SIGTERM, SIGINT): the run did not finish, and nothing is lost
    return 0


def cmd_checkpoints(a: argparse.Namespace) -> int:
    from maxtext_moe.run import run_dir, train

    ref, overrides = split_recipe(a.args)
    print(run_dir.describe(train.run_paths(resolve(ref, overrides)).run))
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from maxtext_moe.run import distributed
    from maxtext_moe.tools import bench

    resolved = resolve(a.recipe, a.overrides)
    with fit_checked(a.recipe, a.overrides, resolved, leader=distributed.detect().process_id == 0):
        result = bench.run(resolved, steps=a.steps, warmup=a.warmup, profile=a.profile)
    if result is None:  # not the reporting process of a multi-process run
        return 0
    if a.out:
        bench.write_json(result, Path(a.out))
    print(json.dumps(result.to_json(), indent=2, default=str) if a.json else result.render())
    if not result.loss_finite_and_falling:
        raise UserError(
            f"the loss was not finite and falling over the timed steps ({result.loss_first:.4f} -> "
            f"{result.loss_last:.4f}); a benchmark of a model that does not learn is void.",
            fix="check the learning rate and the data.",
        )
    return 0


def cmd_report(a: argparse.Namespace) -> int:
    from maxtext_moe.run import job_report, train

    ref, overrides = split_recipe(a.args)
    text, repeats = job_report.line(train.run_paths(resolve(ref, overrides)).run)
    print(text)
    return job_report.USER_ERROR if repeats else 0
