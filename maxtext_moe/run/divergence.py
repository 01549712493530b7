"""Carry out the recipe's `guard:` action on a non-finite loss or norm, or a loss spike, and never leave a
non-finite checkpoint behind.

MaxText detects both but has no policy: it aborts on a NaN or Inf loss (`abort_on_nan_loss`) with
`sys.exit(1)` and a line in its own log only, and its spike wrapper (`skip_step_on_spikes`) zeroes the
update of a step whose loss or gradient norm is above mean + k std of the last steps and reports it
as `optim/step_skipped`. It writes a step's metrics one step late, after that step's checkpoint is
saved, so a poisoned state can already be a complete checkpoint that every re-run resumes from.

Here a `Watcher` sees each metrics line as it is written (fed by `progress.Progress`): it counts every
event in TensorBoard (`GuardCounts`) and, where the action is to stop or roll back, stops MaxText with a
SIGTERM, which MaxText's autocheckpoint turns into a checkpoint at the next step and a clean exit.
When MaxText has ended, however it ended, `guard` finds the first bad step in what this run wrote,
moves the checkpoints of that step and later aside (renamed, never deleted) and then raises one
`UserError` (stop) or `RolledBack` (rollback, see `rollback.py`). MaxText's `learning/param_norm` is the
norm of the parameters the step's checkpoint holds, and every step before the first bad one has
finite loss and norms, so the checkpoints kept are finite.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.guard import GuardSettings
from maxtext_moe.run import rollback, run_dir
from maxtext_moe.run.guard_counts import GuardCounts

WATCHED = ("learning/loss", "learning/grad_norm", "learning/raw_grad_norm", "learning/param_norm")
SKIPPED = "optim/step_skipped"  # 1.0 where MaxText's spike wrapper zeroed the step's update
# What MaxText's spike wrapper compares with mean + k std (the loss, and the clipped gradient norm).
SPIKE_METRICS = ("learning/loss", "learning/grad_norm")


@dataclass(frozen=True)
class BadStep:
    step: int  # MaxText's 0-based step
    kind: str  # "non-finite" or "spike"
    metric: str
    value: float


def classify(m: dict, spikes: bool) -> BadStep | None:
    """What is wrong with one metrics line: a non-finite watched scalar, or (`spikes`) a rejected update."""
    step = int(m["step"])
    for key in WATCHED:
        value = m.get(key)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return BadStep(step, "non-finite", key, float(value))
    if spikes and m.get(SKIPPED) == 1:
        return BadStep(step, "spike", "learning/loss", float(m["learning/loss"]))
    return None


def skipped_safely(m: dict) -> bool:
    """A step whose update the spike wrapper zeroed (a spike, or a non-finite loss or gradient norm with
    `upstream.skip_nonfinite`) and whose parameters are still finite: under `skip`, the action is done."""
    norm = m.get("learning/param_norm")
    return m.get(SKIPPED) == 1 and not (isinstance(norm, (int, float)) and not math.isfinite(norm))


def _lines(metrics_file: Path, offset: int = 0) -> Iterator[dict]:
    if not metrics_file.is_file():
        return
    with open(metrics_file, "rb") as f:
        f.seek(offset)
        text = f.read().decode("utf-8", errors="replace")
    for line in text.splitlines():
        try:
            m = json.loads(line)
            int(m["step"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
        yield m


def first_bad_step(metrics_file: Path, offset: int = 0, spikes: bool = False, skipping: bool = False) -> BadStep | None:
    """The first bad step (`classify`) among the lines written from byte `offset` on; with `skipping`
    (`guard.action: skip`), steps the wrapper skipped safely are not bad."""
    return next(
        (
            bad
            for m in _lines(metrics_file, offset)
            if (bad := classify(m, spikes)) and not (skipping and skipped_safely(m))
        ),
        None,
    )


def spike_threshold(metrics_file: Path, step: int, settings: GuardSettings) -> tuple[str, float, float] | None:
    """(metric, value, threshold) for the message: MaxText's rule (mean + k std, Bessel-corrected, of the
    last `window` steps) restated over the metrics file, naming the first metric above it."""
    by_step = {int(m["step"]): m for m in _lines(metrics_file)}
    if step not in by_step or settings.loss_spike is None:
        return None
    for key in SPIKE_METRICS:
        history = [by_step[s][key] for s in range(step - settings.window, step) if key in by_step.get(s, {})]
        if len(history) >= 2 and key in by_step[step]:
            threshold = statistics.mean(history) + settings.loss_spike * statistics.stdev(history)
            if by_step[step][key] > threshold:
                return key, float(by_step[step][key]), threshold
    return None


def set_aside(checkpoint_dir: Path, from_step: int, why: str = "nonfinite") -> Path | None:
    """Move checkpoints (and interrupted saves) of `from_step` and later out of the resume path, into a new
    `checkpoints.<why>-<time>` folder."""
    doomed = [
        p
        for p in (sorted(checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else [])
        if p.name.split(".")[0].isdigit() and int(p.name.split(".")[0]) >= from_step
    ]
    if not doomed:
        return None
    stem = checkpoint_dir.parent / f"checkpoints.{why}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside = next(p for n in itertools.count() if not (p := stem.with_name(stem.name + (f"-{n}" if n else ""))).exists())
    aside.mkdir()
    for p in doomed:
        p.rename(aside / p.name)
    return aside


class Watcher:
    """Sees each metrics line as MaxText writes it: counts guard events, and asks MaxText to stop where the
    action needs the run to end (a spike under `stop`, anything under `rollback`)."""

    def __init__(self, settings: GuardSettings, counts: GuardCounts):
        self.settings = settings
        self.counts = counts
        self.stopping = False  # a SIGTERM was sent in this attempt

    @property
    def spikes_stop(self) -> bool:
        """Whether a rejected update ends the run (under `skip` MaxText's wrapper skipping it is the action)."""
        return self.settings.loss_spike is not None and self.settings.action != "skip"

    def see(self, m: dict) -> None:
        bad = classify(m, spikes=self.settings.loss_spike is not None)
        if bad is None:
            return
        step = bad.step
        if m.get(SKIPPED) == 1:
            self.counts.add("skipped_steps", step)
        self.counts.add("spikes" if bad.kind == "spike" else "non_finite", step)
        if self.settings.action == "skip" and skipped_safely(m):
            return
        # A non-finite loss under stop ends in MaxText's own abort (it is off under skip and rollback); a
        # rollback needs a checkpoint past it.
        ends = (
            self.settings.action == "rollback"
            or (bad.kind == "spike" and self.spikes_stop)
            or (bad.kind == "non-finite" and self.settings.action == "skip")
        )
        if ends and not self.stopping:
            self.stopping = True
            os.kill(os.getpid(), signal.SIGTERM)


def _resume_from(checkpoint_dir: Path) -> str:
    latest = run_dir.scan(checkpoint_dir).latest
    return f"checkpoint {latest}" if latest is not None else "scratch (no finite checkpoint is left)"


def _what(bad: BadStep, metrics_file: Path, settings: GuardSettings) -> str:
    if bad.kind == "non-finite":
        return f"{bad.metric} is {bad.value}"
    found = spike_threshold(metrics_file, bad.step, settings)
    rule = f"mean + {settings.loss_spike:g} std of the last {settings.window} steps, guard.loss_spike"
    if found is None:
        return f"loss {bad.value:.4f}; MaxText's spike check ({rule}) rejected the update"
    key, value, threshold = found
    return f"{key} {value:.4f} is above the threshold {threshold:.4f} ({rule})"


def conclude(
    watcher: Watcher, metrics_file: Path, offset: int, checkpoint_dir: Path, total_steps: int, learning_rate: object
) -> None:
    """After MaxText ended: if this run wrote a bad step, set its checkpoints aside and act on it."""
    bad = first_bad_step(metrics_file, offset, spikes=watcher.spikes_stop, skipping=watcher.settings.action == "skip")
    if bad is None:
        return
    what = _what(bad, metrics_file, watcher.settings)
    aside = set_aside(checkpoint_dir, bad.step, "nonfinite" if bad.kind == "non-finite" else "spike")
    moved = f"; checkpoints {bad.step} and later were moved to {aside}" if aside else ""
    where = f"{'diverged' if bad.kind == 'non-finite' else 'hit a loss spike'} at step {bad.step + 1} of {total_steps}"
    if watcher.settings.action == "rollback":
        raise rollback.roll_back(
            checkpoint_dir, aside, bad.step, f"training {where}: {what}{moved}", watcher.settings, watcher.counts
        )
    fix = f"lower learning_rate (now {learning_rate}) or raise warmup_steps_fraction, then run the same command"
    if bad.kind == "spike":
        fix += "; or set guard.action: skip (or rollback) to go on past such batches, or raise guard.loss_spike"
    raise UserError(
        f"training {where}: {what}{moved}. A re-run resumes from {_resume_from(checkpoint_dir)}.", fix=fix + "."
    )


@contextmanager
def guard(
    watcher: Watcher,
    metrics_file: Path,
    checkpoint_dir: Path,
    total_steps: int,
    learning_rate: object,
    *,
    enabled: bool,
) -> Iterator[None]:
    """Act on the metrics this run writes however MaxText ends (its NaN abort is a SystemExit)."""
    offset = metrics_file.stat().st_size if metrics_file.is_file() else 0
    watcher.stopping = False

    def run_check() -> None:
        if enabled:
            truncated = metrics_file.is_file() and metrics_file.stat().st_size < offset  # MaxText restarts it at step 0
            conclude(watcher, metrics_file, 0 if truncated else offset, checkpoint_dir, total_steps, learning_rate)

    try:
        yield
    except BaseException as e:
        try:
            run_check()
        except (UserError, rollback.RolledBack) as acted:
            raise acted from e
        raise
    run_check()
