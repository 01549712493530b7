"""Count the divergence guard's events as TensorBoard scalars beside MaxText's own.

MaxText records `optim/step_skipped` per step (0 or 1) and nothing at all for a NaN it aborts on or a
rollback, which happens between its runs. These counters are cumulative (`guard/skipped_steps`,
`guard/spikes`, `guard/non_finite`, `guard/rollbacks`), written at the step of each event into the
run's TensorBoard folder with tensorboardX (MaxText's writer), so one chart shows how often a run
needed the guard.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

EVENTS = ("skipped_steps", "spikes", "non_finite", "rollbacks")


class GuardCounts:
    """Cumulative event counts; `folder` None (a process other than the first) counts without writing."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self._counts: Counter[str] = Counter()
        self._writer = None

    def add(self, event: str, step: int) -> int:
        """Count one `event` at MaxText's `step`; returns the new total."""
        assert event in EVENTS, event
        self._counts[event] += 1
        if self.folder is not None:
            if self._writer is None:
                from tensorboardX import SummaryWriter

                # tensorboardX names event files by the second and the host: without a suffix of its own, a
                # file opened in the same second as MaxText's (a rollback restarts MaxText) would be shared.
                self._writer = SummaryWriter(str(self.folder), filename_suffix=".guard")
            self._writer.add_scalar(f"guard/{event}", self._counts[event], step)
            self._writer.flush()
        return self._counts[event]

    def total(self, event: str) -> int:
        return self._counts[event]

    def close(self) -> None:
        """Close the event file; a later event (after a rollback) opens another in the same folder."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
