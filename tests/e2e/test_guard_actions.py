"""The divergence guard's actions on a real loss spike: stop, skip, and roll back with the data advanced.

A learning rate of 2.0 reached over half the run (warm-up) makes the tiny model's loss jump a few steps in,
after MaxText's spike check has its first 3 steps to compare with (`guard.window=8`). Each test runs
`python -m maxtext_moe train` in a subprocess and reads what the user reads, the metrics MaxText wrote,
the Orbax folders and the TensorBoard event files.
"""

from __future__ import annotations

import json
import math
import re

import pytest
from conftest import FAST, read_metrics, run_cli, tensorboard_scalars

from maxtext_moe.run import run_dir

pytestmark = pytest.mark.slow
RUN = "deepseek3-tiny-cpu"
SPIKE = [
    "steps=8",
    "checkpoint_period=2",
    "learning_rate=2.0",
    "warmup_steps_fraction=0.5",
    "guard.loss_spike=3",
    "guard.window=8",
    *FAST,
    "corpus.max_mib=1",
]


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("maxtext-moe: error:")]


def _guard_scalars(run) -> dict[str, list[tuple[int, float]]]:
    """guard/* scalars over every event file of the run (each attempt writes its own)."""
    found: dict[str, list[tuple[int, float]]] = {}
    for f in sorted((run / "tensorboard" / RUN).glob("events.out.tfevents.*")):
        for tag, points in tensorboard_scalars(f).items():
            if tag.startswith("guard/"):
                found.setdefault(tag, []).extend(points.items())
    return found


def _skipped_on_progress(stdout: str, why: str = "spike") -> list[int]:
    """MaxText's 0-based steps whose progress line says the update was skipped, for `why`."""
    ending = f"skipped ({why})"
    return [int(line.split()[1].split("/")[0]) - 1 for line in stdout.splitlines() if line.endswith(ending)]


def test_a_loss_spike_stops_with_one_line_naming_the_step_the_loss_and_the_threshold(tmp_path):
    r = run_cli("train", *SPIKE, f"base_output_directory={tmp_path}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (error,) = _errors(r.stderr)
    m = re.search(
        r"hit a loss spike at step (\d+) of 8: learning/loss ([\d.]+) is above the threshold ([\d.]+) ", error
    )
    assert m and "(mean + 3 std of the last 8 steps, guard.loss_spike)" in error, error
    step, run = int(m[1]) - 1, tmp_path / RUN
    metrics = read_metrics(run)
    assert metrics[step]["optim/step_skipped"] == 1 and f"{metrics[step]['learning/loss']:.4f}" == m[2]
    assert float(m[2]) > float(m[3]) and all(metrics[s]["optim/step_skipped"] == 0 for s in range(step))
    kept = run_dir.scan(run / "checkpoints").complete
    (aside,) = run.glob("checkpoints.spike-*")
    assert kept and max(kept) < step <= min(int(p.name) for p in aside.iterdir())
    assert f"A re-run resumes from checkpoint {max(kept)}." in error and "Fix: lower learning_rate (now 2.0)" in error
    assert step in _skipped_on_progress(r.stdout)
    assert _guard_scalars(run)["guard/spikes"][0] == (step, 1.0)


def test_skip_goes_on_past_each_spike_and_counts_it(tmp_path):
    r = run_cli("train", *SPIKE, "guard.action=skip", f"base_output_directory={tmp_path}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = tmp_path / RUN
    skipped = sorted(s for s, m in read_metrics(run).items() if m["optim/step_skipped"] == 1)
    assert skipped and _skipped_on_progress(r.stdout) == skipped
    assert _guard_scalars(run)["guard/skipped_steps"] == [(s, float(n)) for n, s in enumerate(skipped, 1)]
    assert run_dir.scan(run / "checkpoints").latest == 7 and not list(run.glob("checkpoints.*"))


def test_skip_goes_on_past_non_finite_steps_with_finite_parameters(tmp_path):
    nan = ["steps=8", "checkpoint_period=2", "learning_rate=1.0e+6", "guard.loss_spike=3", "guard.window=8"]
    r = run_cli("train", *nan, *FAST, "corpus.max_mib=1", "guard.action=skip", f"base_output_directory={tmp_path}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    run = tmp_path / RUN
    metrics = read_metrics(run)
    non_finite = sorted(s for s, m in metrics.items() if not math.isfinite(m["learning/loss"]))
    assert non_finite and all(metrics[s]["optim/step_skipped"] == 1 for s in non_finite)
    assert all(math.isfinite(m["learning/param_norm"]) for m in metrics.values())  # no NaN reached the weights
    assert run_dir.scan(run / "checkpoints").latest == 7 and not list(run.glob("checkpoints.*"))
    assert [s for s in _skipped_on_progress(r.stdout, "non-finite")] == non_finite
    assert [s for s, _ in _guard_scalars(run)["guard/non_finite"]] == non_finite


def test_rollback_resumes_from_the_last_good_checkpoint_with_the_data_past_the_bad_batch(tmp_path):
    r = run_cli("train", *SPIKE, "guard.action=rollback", "guard.max_rollbacks=1", f"base_output_directory={tmp_path}")
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("guard: ")]
    m = re.search(
        r"spike at step (\d+) of 8: .* Rollback 1 of at most 1: resuming from checkpoint (\d+) "
        r"with the data of checkpoint (\d+) ",
        line,
    )
    assert m, line
    bad, good, source = int(m[1]) - 1, int(m[2]), int(m[3])
    run = tmp_path / RUN
    first = sorted(run.glob("checkpoints.spike-*"))[0]
    assert good < bad <= source and good in run_dir.scan(run / "checkpoints").complete
    state = "iter/process_0-of-1.json"
    assert (run / "checkpoints" / str(good) / state).read_text() == (first / str(source) / state).read_text()
    before = json.loads((first / f"iter-of-checkpoint-{good}" / "process_0-of-1.json").read_text())
    assert before != json.loads((run / "checkpoints" / str(good) / state).read_text())  # kept, not lost
    # The step after the good checkpoint ran twice from the same state: on other data the second time.
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    again = [x["learning/loss"] for x in lines if int(x["step"]) == good + 1]
    assert len(again) == 2 and again[0] != again[1], again
    # The learning rate, not the data, makes this spike: it comes back and the cap stops the run.
    assert r.returncode == 2, r.stderr[-3000:]
    (error,) = _errors(r.stderr)
    assert "stopping after 1 rollback(s) (guard.max_rollbacks)" in error
    assert _guard_scalars(run)["guard/rollbacks"] == [(bad, 1.0)]


def test_rollback_on_a_nan_loss_leaves_no_non_finite_checkpoint(tmp_path):
    common = ["steps=8", "checkpoint_period=2", "learning_rate=1.0e+6", *FAST, "corpus.max_mib=1"]
    r = run_cli("train", *common, "guard.action=rollback", "guard.max_rollbacks=1", f"base_output_directory={tmp_path}")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("guard: ")]
    assert "learning/loss is nan" in line and "Rollback 1 of at most 1: resuming from checkpoint " in line
    (error,) = _errors(r.stderr)
    assert "stopping after 1 rollback(s)" in error
    run = tmp_path / RUN
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    first_nan = min(int(x["step"]) for x in lines if x["learning/loss"] != x["learning/loss"])
    kept = run_dir.scan(run / "checkpoints").complete
    assert kept and max(kept) < first_nan  # MaxText trained on past the NaN (no abort); none of it is kept
    assert [n for _, n in _guard_scalars(run)["guard/rollbacks"]] == [1.0]


def test_rollback_on_synthetic_data_says_the_data_is_not_advanced(tmp_path):
    args = [*SPIKE, "dataset_type=synthetic", "guard.action=rollback", "guard.max_rollbacks=1"]
    r = run_cli("train", *args, f"base_output_directory={tmp_path}")
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("guard: ")]
    assert "with the data as MaxText gives it (these checkpoints hold no data position to advance)" in line, line
    assert r.returncode == 2 and not list((tmp_path / RUN).glob("checkpoints.spike-*/iter-of-checkpoint-*"))
