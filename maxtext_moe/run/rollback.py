"""Roll back to the last good checkpoint with the data advanced past the bad batch (`guard.action: rollback`).

MaxText resumes from the latest checkpoint and has no way to skip data on resume. With Grain, the data
position is part of each checkpoint: `<step>/iter/process_<i>-of-<n>.json`, the iterator's state after
that step's batch, restored as it stands. When the guard stops a bad run, MaxText saves a checkpoint
at a step S at or after the bad step B, so S's iterator state is past the bad batch. This module puts
that state into the last good checkpoint J (keeping J's own beside the set-aside checkpoints): the run
resumes at step J+1 with the batch after S. The batches of steps J+1..S, the bad one among them, are
not trained on (PaLM's recipe for spikes: restart before the spike and skip the batches around it).

A run without iterator state in its checkpoints (synthetic data) resumes from J with the data as
MaxText gives it; that is said in the message.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.guard import GuardSettings
from maxtext_moe.run import run_dir
from maxtext_moe.run.guard_counts import GuardCounts

ITER = "iter"  # MaxText's checkpoint item for the data iterator


class RolledBack(Exception):
    """The bad checkpoints are set aside and the data advanced: train again from the latest checkpoint."""


def _iterator_states(step_dir: Path) -> list[Path]:
    return sorted((step_dir / ITER).glob("process_*.json"))


def advance_data(checkpoint_dir: Path, aside: Path | None, good: int) -> int | None:
    """Give checkpoint `good` the iterator state of the earliest complete checkpoint set aside in `aside`;
    returns that checkpoint's step, or None when `good` holds no iterator state."""
    target = checkpoint_dir / str(good) / ITER
    if not _iterator_states(checkpoint_dir / str(good)):
        return None
    past = [s for s in (run_dir.scan(aside).complete if aside else []) if _iterator_states(aside / str(s))]
    if not past:
        raise UserError(
            f"cannot roll back past the bad batch: no checkpoint saved after it holds the data position "
            f"(looked in {aside}).",
            fix="resume with the same command (the batch is trained again), or lower learning_rate.",
        )
    source = min(past)
    kept = aside / f"iter-of-checkpoint-{good}"
    kept.mkdir(exist_ok=True)
    for f in _iterator_states(checkpoint_dir / str(good)):
        shutil.move(f, kept / f.name)
    for f in _iterator_states(aside / str(source)):
        shutil.copy2(f, target / f.name)
    return source


def roll_back(
    checkpoint_dir: Path, aside: Path | None, bad_step: int, what: str, settings: GuardSettings, counts: GuardCounts
) -> RolledBack:
    """Prepare the next attempt after `what` happened at `bad_step` (its checkpoints already in `aside`)."""
    done = counts.total("rollbacks")
    good = run_dir.scan(checkpoint_dir).latest
    if done >= settings.max_rollbacks or good is None:
        why = f"after {done} rollback(s) (guard.max_rollbacks)" if good is not None else "with no checkpoint before it"
        raise UserError(
            f"{what}; stopping {why}. A re-run resumes from "
            + (f"checkpoint {good}." if good is not None else "scratch."),
            fix="lower learning_rate or raise warmup_steps_fraction, then run the same command.",
        )
    source = advance_data(checkpoint_dir, aside, good)
    counts.add("rollbacks", bad_step)
    data = (
        f"with the data of checkpoint {source} (the batches of steps {good + 2}..{source + 1} are skipped)"
        if source is not None
        else "with the data as MaxText gives it (these checkpoints hold no data position to advance)"
    )
    return RolledBack(
        f"{what}. Rollback {done + 1} of at most {settings.max_rollbacks}: resuming from checkpoint {good} {data}."
    )
