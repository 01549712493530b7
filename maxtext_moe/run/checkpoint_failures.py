"""One line for a checkpoint restore or save that failed inside MaxText.

The gap: Orbax reports a failed restore as a "incompatible handler" error that embeds the whole abstract
state tree (82 KB for the tiny model), and a failed save as "Checkpointing failed" after its writer
threads have logged their tracebacks; the cause (a ZSTD frame that does not decode, no space left on
the device) is the innermost error of the chain (`errors.root_cause`). This module names the step, the
cause and the fix.
"""

from __future__ import annotations

import errno
import re
import warnings
from pathlib import Path

from maxtext_moe.errors import UserError, brief, root_cause
from maxtext_moe.run import disk_space, run_dir


def explain(
    e: BaseException, ckpt_dir: Path, found: run_dir.Checkpoints, *, resuming: bool, log: Path
) -> UserError | None:
    """The user's error for `e`, raised by MaxText's training in a run whose checkpoints are in `ckpt_dir`
    (`found` before it started; `resuming`: no step ran yet). None when `e` is not a checkpoint failure."""
    cause = root_cause(e)
    if getattr(cause, "errno", None) == errno.ENOSPC or "No space left on device" in str(cause):
        return _no_space(cause, ckpt_dir)
    if not resuming or found.latest is None:
        return None
    # Orbax's load coroutines, abandoned by the failed restore, would each print a "never awaited" warning
    # at exit: noise after the one line that says what failed.
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    step_dir = ckpt_dir / str(found.latest)
    earlier = max((s for s in found.complete if s < found.latest), default=None)
    resume = f"resume from step {earlier}" if earlier is not None else "start from scratch"
    if str(step_dir) in str(cause):  # the innermost error names a file of that checkpoint: it is at fault
        return UserError(
            f"the checkpoint at step {found.latest} cannot be read: {brief(cause)}. Nothing was deleted.",
            fix=f"move {step_dir} out of {ckpt_dir} to {resume}, or choose another run_name; details in {log}.",
        )
    return UserError(
        f"MaxText failed before its first step while resuming from the checkpoint at step {found.latest} "
        f"in {ckpt_dir}: {brief(cause)}. Nothing was deleted.",
        fix=f"if the checkpoint is at fault, move {step_dir} out of {ckpt_dir} to {resume}, or choose another "
        f"run_name; details in {log}.",
    )


def _no_space(cause: BaseException, ckpt_dir: Path) -> UserError:
    fs = disk_space.filesystem(ckpt_dir)
    saving = re.search(rf"{re.escape(str(ckpt_dir))}/(\d+)\.{run_dir.TMP_MARK}", str(cause))
    latest = run_dir.scan(ckpt_dir).latest
    kept = f"the latest complete checkpoint is step {latest}" if latest is not None else "no checkpoint is complete"
    what = f"saving checkpoint {saving.group(1)} in {ckpt_dir}" if saving else f"training ({brief(cause, 240)})"
    return UserError(
        f"no space left on {fs} while {what}; {kept}. Nothing was deleted.",
        fix=f"free space on {fs.mount} (older runs, checkpoints.set-aside-* folders) or move the run folder to a "
        "larger filesystem (base_output_directory), then run the same command to resume.",
    )
