"""Stop on a non-finite loss, say so in one line, and never leave a non-finite checkpoint behind.

MaxText aborts on a NaN or Inf loss (`abort_on_nan_loss`, `abort_on_inf_loss`) with `sys.exit(1)`
and a line in its own log only. It writes a step's metrics one step late, after that step's
checkpoint is saved, so by the time it aborts the poisoned state can already be a complete
checkpoint that every re-run resumes from. This module reads the metrics the run wrote and, on the
first step whose loss, gradient norm or parameter norm is not finite, moves the checkpoints of that
step and later aside (renamed, never deleted) and raises one `UserError` naming the step, the value,
the checkpoint a re-run resumes from and the fix.

MaxText's `learning/param_norm` is the norm of the parameters after the step's update, the ones the
step's checkpoint holds; every step before the first bad one has finite loss and norms, so its
checkpoint is finite.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.run import run_dir

WATCHED = ("learning/loss", "learning/grad_norm", "learning/raw_grad_norm", "learning/param_norm")


def first_bad_step(metrics_file: Path, offset: int = 0) -> tuple[int, str, float] | None:
    """(step, metric, value) of the first non-finite watched scalar written from byte `offset` on."""
    if not metrics_file.is_file():
        return None
    with open(metrics_file, "rb") as f:
        f.seek(offset)
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    for line in lines:
        try:
            m = json.loads(line)
            step = int(m["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        for key in WATCHED:
            value = m.get(key)
            if isinstance(value, (int, float)) and not math.isfinite(value):
                return step, key, float(value)
    return None


def set_aside(checkpoint_dir: Path, from_step: int) -> Path | None:
    """Move checkpoints (and interrupted saves) of `from_step` and later out of the resume path."""
    doomed = [
        p
        for p in (sorted(checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else [])
        if p.name.split(".")[0].isdigit() and int(p.name.split(".")[0]) >= from_step
    ]
    if not doomed:
        return None
    aside = checkpoint_dir.parent / f"checkpoints.nonfinite-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(exist_ok=True)
    for p in doomed:
        p.rename(aside / p.name)
    return aside


def check(metrics_file: Path, checkpoint_dir: Path, offset: int, total_steps: int, learning_rate: object) -> None:
    """Raise the divergence error when the metrics written from `offset` on hold a non-finite value."""
    bad = first_bad_step(metrics_file, offset)
    if bad is None:
        return
    step, key, value = bad
    aside = set_aside(checkpoint_dir, step)
    latest = run_dir.scan(checkpoint_dir).latest
    moved = f"; checkpoints {step} and later hold that state and were moved to {aside}" if aside else ""
    resume = f"checkpoint {latest}" if latest is not None else "scratch (no finite checkpoint is left)"
    raise UserError(
        f"training diverged at step {step + 1} of {total_steps}: {key} is {value}{moved}. "
        f"A re-run resumes from {resume}.",
        fix=f"lower learning_rate (now {learning_rate}) or raise warmup_steps_fraction, then run the same command.",
    )


@contextmanager
def guard(
    metrics_file: Path, checkpoint_dir: Path, total_steps: int, learning_rate: object, *, enabled: bool
) -> Iterator[None]:
    """Check the metrics this run writes however MaxText ends (its NaN abort is a SystemExit)."""
    offset = metrics_file.stat().st_size if metrics_file.is_file() else 0

    def run_check() -> None:
        if enabled:
            truncated = metrics_file.is_file() and metrics_file.stat().st_size < offset  # MaxText restarts it at step 0
            check(metrics_file, checkpoint_dir, 0 if truncated else offset, total_steps, learning_rate)

    try:
        yield
    except BaseException as e:
        try:
            run_check()
        except UserError as diverged:
            raise diverged from e
        raise
    run_check()
