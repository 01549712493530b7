"""Faults a user meets in real training on the CPU: a diverging loss, two runs in one folder, Ctrl-C.

Each test runs `python -m maxtext_moe train` in subprocesses and sends real signals; what it
checks is on disk afterwards (Orbax checkpoint folders, the lock file) and in what the user reads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from conftest import FAST, run_cli

from maxtext_moe.run import lock, run_dir

pytestmark = pytest.mark.slow
SMALL = [*FAST, "corpus.max_mib=1"]
RUN = "deepseek3-tiny-cpu"


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("maxtext-moe: error:")]


def test_a_nan_loss_stops_with_one_line_and_a_rerun_resumes_from_a_finite_checkpoint(tmp_path):
    common = ["steps=8", "checkpoint_period=2", f"base_output_directory={tmp_path}", *SMALL]
    r = run_cli("train", *common, "learning_rate=1.0e+6")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = _errors(r.stderr)
    assert len(errors) == 1, r.stderr[-3000:]
    assert "training diverged at step " in errors[0] and "learning/loss is nan" in errors[0]
    assert "Fix: lower learning_rate (now 1000000.0)" in errors[0]
    ckpt = tmp_path / RUN / "checkpoints"
    kept = run_dir.scan(ckpt).complete
    (aside,) = (tmp_path / RUN).glob("checkpoints.nonfinite-*")
    moved = sorted(int(p.name) for p in aside.iterdir())
    assert kept and moved and max(kept) < min(moved), (kept, moved)
    assert f"A re-run resumes from checkpoint {max(kept)}." in errors[0] and str(aside) in errors[0]
    r = run_cli("train", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {max(kept) + 1}" in r.stdout
    assert "loss nan" not in r.stdout and run_dir.scan(ckpt).latest == 7


def _start(tmp_path, *extra):
    args = [sys.executable, "-m", "maxtext_moe", "train", "steps=400", "checkpoint_period=1000"]
    args += [f"base_output_directory={tmp_path}", *SMALL, *extra]
    return subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )


def _wait_for_step(proc, step: int) -> list[str]:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"step {step:>5}/"):
            return seen
    raise AssertionError("".join(seen) + proc.stderr.read()[-3000:])


def test_a_second_run_in_the_same_folder_is_refused_at_once(tmp_path):
    first = _start(tmp_path)
    try:
        _wait_for_step(first, 2)
        t0 = time.monotonic()
        r = run_cli("train", "steps=400", f"base_output_directory={tmp_path}", *SMALL)
        assert r.returncode == 2 and time.monotonic() - t0 < 60
        (error,) = _errors(r.stderr)
        assert f"is in use by another training run (PID {first.pid} on {socket.gethostname()}" in error
        assert "loss" not in r.stdout
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=180)
    assert first.returncode == 143 and not (tmp_path / RUN / lock.LOCK).exists()


def test_ctrl_c_checkpoints_the_current_step_and_a_rerun_resumes(tmp_path):
    proc = _start(tmp_path)
    seen = _wait_for_step(proc, 6)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, "".join(seen) + out + err[-3000:]
    assert "on Ctrl-C; its checkpoint is saved" in err and "Traceback" not in err
    saved = run_dir.scan(tmp_path / RUN / "checkpoints").complete
    assert saved[0] == 0 and len(saved) == 2 and saved[1] >= 6, saved  # step 0 and the step Ctrl-C reached
    more = [f"steps={saved[1] + 3}", "learning_rate_schedule_steps=400"]  # the same schedule, fewer steps
    r = run_cli("train", *more, f"base_output_directory={tmp_path}", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {saved[1] + 1}" in r.stdout


def test_a_second_ctrl_c_aborts_at_once(tmp_path):
    proc = _start(tmp_path)
    _wait_for_step(proc, 2)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)  # two signals at once would reach Python's handler as one
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err[-3000:]
    assert "aborted by a second Ctrl-C" in err
