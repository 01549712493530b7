"""The guard's TensorBoard counters beside MaxText's own writer in the same folder."""

from __future__ import annotations

from conftest import tensorboard_scalars
from tensorboardX import SummaryWriter

from maxtext_moe.run.guard_counts import GuardCounts


def test_counts_and_maxtexts_scalars_opened_in_the_same_second_both_survive(tmp_path):
    # tensorboardX names an event file by the second and the host: two writers opened in one second (MaxText's
    # after a rollback restarts it, and the guard's) would share one file and corrupt each other's records.
    maxtext = SummaryWriter(str(tmp_path))
    counts = GuardCounts(tmp_path)
    counts.add("rollbacks", 3)
    maxtext.add_scalar("learning/loss", 2.5, 3)
    for step in range(4, 40):
        maxtext.add_scalar("learning/loss", 2.0, step)
        counts.add("skipped_steps", step)
    maxtext.close()
    counts.close()
    scalars: dict[str, dict[int, float]] = {}
    for f in sorted(tmp_path.glob("events.out.tfevents.*")):
        scalars |= tensorboard_scalars(f)
    assert scalars["guard/rollbacks"] == {3: 1.0}
    assert scalars["guard/skipped_steps"][39] == 36.0 and len(scalars["learning/loss"]) == 37
