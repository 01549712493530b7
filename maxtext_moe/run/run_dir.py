"""Guard a run's output folder before MaxText touches it.

MaxText resumes from whatever Orbax checkpoint it finds under `base_output_directory/run_name`,
whichever recipe wrote it, and an incomplete or damaged latest checkpoint surfaces as a deep Orbax
traceback. This module adds the missing guards: a run folder records which recipe and model shape
own it, a different recipe is refused unless `--force` (which sets the old checkpoints aside under
a new name, never deletes them), and the latest checkpoint is checked for completeness first.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.run import checkpoint_data

IDENTITY = "maxtext-moe-run.json"
TMP_MARK = "orbax-checkpoint-tmp"


@dataclass(frozen=True)
class Checkpoints:
    """What the checkpoint folder holds: complete steps, interrupted saves, damaged steps."""

    complete: list[int]
    partial: list[str]
    damaged: dict[int, str]

    @property
    def latest(self) -> int | None:
        return max(self.complete) if self.complete else None


def _problem(step_dir: Path) -> str | None:
    """Why `step_dir` is not a complete Orbax checkpoint, or None when it is."""
    meta = step_dir / "_CHECKPOINT_METADATA"
    if not meta.is_file():
        return "it has no _CHECKPOINT_METADATA (the save did not finish)"
    try:
        json.loads(meta.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        return f"its _CHECKPOINT_METADATA is unreadable ({e})"
    items = step_dir / "items"
    if not items.is_dir():
        return "it has no 'items' folder (the model state is missing)"
    if not (items / "_METADATA").is_file():
        return "its 'items' folder has no _METADATA (the model state is incomplete)"
    try:
        json.loads((items / "_METADATA").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        return f"its items/_METADATA is unreadable ({e})"
    return checkpoint_data.problem(items)


def scan(checkpoint_dir: Path) -> Checkpoints:
    complete, partial, damaged = [], [], {}
    if checkpoint_dir.is_dir():
        for entry in sorted(checkpoint_dir.iterdir()):
            if TMP_MARK in entry.name:
                partial.append(entry.name)
            elif entry.is_dir() and entry.name.isdigit():
                why = _problem(entry)
                if why is None:
                    complete.append(int(entry.name))
                else:
                    damaged[int(entry.name)] = why
    return Checkpoints(sorted(complete), partial, damaged)


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(set(old) | set(new))
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    return "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else "")


def _optimizer_changes(old: dict[str, Any] | None, new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """The optimizer keys whose change alters the saved state's tree (`checkpoint_identity`). Identity files
    written before the optimizer was recorded, or before a key was, match any value: they still resume."""
    return [(k, old[k], v) for k, v in new.items() if old is not None and k in old and old[k] != v]


def prepare(run_dir: Path, identity: dict[str, Any], *, force: bool, log=print) -> Checkpoints:
    """Check `run_dir` against this recipe's identity; record the identity; report what resumes."""
    ckpt_dir = run_dir / "checkpoints"
    found = scan(ckpt_dir)
    id_file = run_dir / IDENTITY
    has_any = bool(found.complete or found.partial or found.damaged)
    owner = None
    if id_file.is_file():
        try:
            owner = json.loads(id_file.read_text())
        except json.JSONDecodeError:
            owner = {}
    mismatch, undo = None, ""
    if has_any and owner is None:
        mismatch = f"{ckpt_dir} holds checkpoints that maxtext-moe did not write (no {IDENTITY})"
    elif has_any and (
        owner.get("recipe") != identity["recipe"] or owner.get("model_digest") != identity["model_digest"]
    ):
        detail = _differences(owner.get("model", {}), identity["model"])
        mismatch = (
            f"{ckpt_dir} holds checkpoints of recipe '{owner.get('recipe')}'"
            + (f" with another model shape ({detail})" if detail else "")
            + f", not of '{identity['recipe']}'"
        )
    elif has_any and (changed := _optimizer_changes(owner.get("optimizer"), identity["optimizer"])):
        mismatch = (
            f"{ckpt_dir} holds checkpoints whose optimizer state has another structure "
            f"({'; '.join(f'{k}: {old!r} -> {new!r}' for k, old, new in changed)}), which cannot be restored"
        )
        undo = ", or go back to " + ", ".join(f"{k}={old}" for k, old, _ in changed) + " to resume"
    if mismatch:
        if not force:
            raise UserError(
                f"{mismatch}; refusing to resume from or overwrite them.",
                fix="choose another run_name or base_output_directory, or pass --force to set the "
                f"old checkpoints aside (they are renamed, not deleted) and start fresh{undo}.",
            )
        aside = run_dir / f"checkpoints.set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
        ckpt_dir.rename(aside)
        log(f"--force: moved the other run's checkpoints to {aside}")
        found = Checkpoints([], [], {})
    if found.damaged:
        newest_damaged = max(found.damaged)
        if found.latest is None or newest_damaged > found.latest:
            resume = f"step {found.latest}" if found.latest is not None else "scratch"
            raise UserError(
                f"the latest checkpoint {ckpt_dir / str(newest_damaged)} is unusable: {found.damaged[newest_damaged]}. "
                "Nothing was deleted.",
                fix=f"move that folder out of {ckpt_dir} to resume from {resume}, or choose another run_name.",
            )
    _check_schedule(owner if found.latest is not None else None, identity)
    for name in found.partial:
        log(f"checkpoints: ignoring interrupted save {ckpt_dir / name} ({_fate(name)})")
    run_dir.mkdir(parents=True, exist_ok=True)
    id_file.write_text(json.dumps(identity | {"written_by": "maxtext-moe"}, indent=1, sort_keys=True))
    return found


def _fate(partial: str) -> str:
    """What becomes of an interrupted save. Orbax (0.12, as MaxText creates its checkpointer) cleans up no
    temporary folder at start, but a save of step N first deletes a leftover `N.orbax-checkpoint-tmp`,
    the one name it writes to; any other name stays."""
    step = partial.removesuffix(f".{TMP_MARK}")
    if step.isdigit():
        return f"Orbax deletes it if this run saves step {step}"
    return "left in place; delete it once you no longer need it"


def _check_schedule(owner: dict[str, Any] | None, identity: dict[str, Any]) -> None:
    """Refuse to resume with a learning-rate schedule of another length that only followed `steps`: MaxText
    builds the cosine for the new total, so the rate jumps back up. Setting `learning_rate_schedule_steps`
    to the new length says the change is meant."""
    before = (owner or {}).get("schedule_steps")
    now = identity["schedule_steps"]
    if before is None or before == now or identity["schedule_set"]:
        return
    raise UserError(
        f"the checkpoints were trained on a {before}-step learning-rate schedule, and steps={now} would restart "
        f"it as a {now}-step cosine on resume: the learning rate would jump back up.",
        key="steps",
        fix=f"to re-plan the schedule for {now} steps on purpose, add learning_rate_schedule_steps={now}; "
        f"for runs that grow, set learning_rate_schedule_steps to the final length from the start.",
    )


def describe(run_dir: Path) -> str:
    """What `maxtext-moe checkpoints` prints: the run's owner and each checkpoint with its state."""
    ckpt_dir = run_dir / "checkpoints"
    found = scan(ckpt_dir)
    lines = [f"run folder {run_dir}"]
    id_file = run_dir / IDENTITY
    if id_file.is_file():
        owner = json.loads(id_file.read_text())
        lines.append(f"  written by recipe '{owner.get('recipe')}' (model digest {owner.get('model_digest')})")
    rows = [(s, "complete") for s in found.complete] + [(s, f"DAMAGED: {why}") for s, why in found.damaged.items()]
    if not rows and not found.partial:
        lines.append(f"  no checkpoints in {ckpt_dir}")
    for step, state in sorted(rows):
        path = ckpt_dir / str(step)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(path.stat().st_mtime))
        lines.append(f"  step {step:>7}  {size:9.1f} MiB  {when}  {state}")
    lines += [f"  interrupted save {name} (ignored)" for name in found.partial]
    newest_damaged = max(found.damaged, default=None)
    if newest_damaged is not None and (found.latest is None or newest_damaged > found.latest):
        earlier = f"after step {found.latest}" if found.latest is not None else "from scratch"
        lines.append(
            f"  a re-run stops: the newest checkpoint (step {newest_damaged}) is damaged; "
            f"move it aside to resume {earlier}"
        )
    elif found.latest is not None:
        lines.append(f"  a re-run resumes after step {found.latest} (continues at step {found.latest + 1})")
    return "\n".join(lines)
