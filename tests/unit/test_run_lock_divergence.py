"""The run lock against real processes, and the divergence guard on real metrics lines and folders."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from maxtext_moe.errors import UserError
from maxtext_moe.run import divergence, lock

HOLD = (
    "import sys, time; from pathlib import Path; from maxtext_moe.run import lock; "
    "lock.acquire(Path(sys.argv[1])); print('held', flush=True); time.sleep(60)"
)


def _holder(run_dir):
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_run_is_refused_with_the_first_runs_pid_and_host(tmp_path):
    first = _holder(tmp_path)
    try:
        with pytest.raises(UserError) as e:
            lock.acquire(tmp_path, log=lambda _: None)
        assert f"in use by another training run (PID {first.pid} on {socket.gethostname()}" in str(e.value)
    finally:
        first.kill()
        first.wait()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    first = _holder(tmp_path)
    first.send_signal(signal.SIGKILL)
    first.wait()
    said = []
    path = lock.acquire(tmp_path, log=said.append)
    assert said == [
        f"run lock: taking over {path} left by PID {first.pid} on {socket.gethostname()}, which is no longer running"
    ]
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release(path)
    assert not path.exists()


def test_a_lock_from_another_host_is_left_to_the_user(tmp_path):
    (tmp_path / lock.LOCK).write_text(json.dumps({"pid": 1, "host": "node-elsewhere", "since": "then"}))
    with pytest.raises(UserError, match="in use by a training run on host node-elsewhere .PID 1"):
        lock.acquire(tmp_path)
    assert (tmp_path / lock.LOCK).is_file()


def _metrics(path, rows):
    path.write_text("".join(json.dumps({"step": float(s), **m}) + "\n" for s, m in rows))


def test_the_first_non_finite_loss_or_norm_is_found(tmp_path):
    f = tmp_path / "metrics.jsonl"
    ok = {"learning/loss": 3.0, "learning/grad_norm": 1.0, "learning/param_norm": 9.0}
    _metrics(f, [(0, ok), (1, ok | {"learning/param_norm": float("inf")}), (2, ok | {"learning/loss": float("nan")})])
    assert divergence.first_bad_step(f) == divergence.BadStep(1, "non-finite", "learning/param_norm", float("inf"))
    earlier_run = sum(len(line) for line in f.read_text().splitlines(keepends=True)[:2])  # lines a resume skips
    bad = divergence.first_bad_step(f, earlier_run)
    assert (bad.step, bad.metric) == (2, "learning/loss")
    _metrics(f, [(0, ok), (1, ok)])
    assert divergence.first_bad_step(f) is None


def test_a_step_maxtexts_spike_check_rejected_is_bad_only_where_spikes_stop_the_run(tmp_path):
    f = tmp_path / "metrics.jsonl"
    ok = {"learning/loss": 3.0, "learning/grad_norm": 1.0, "optim/step_skipped": 0.0}
    _metrics(f, [(0, ok), (1, ok | {"learning/loss": 9.0, "optim/step_skipped": 1.0}), (2, ok)])
    assert divergence.first_bad_step(f, spikes=True) == divergence.BadStep(1, "spike", "learning/loss", 9.0)
    assert divergence.first_bad_step(f, spikes=False) is None  # guard.action: skip goes on


def test_checkpoints_from_the_bad_step_on_are_moved_aside_not_deleted(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for name in ("0", "2", "4", "6.orbax-checkpoint-tmp-12"):
        (ckpt / name).mkdir(parents=True)
        (ckpt / name / "data").write_text(name)
    aside = divergence.set_aside(ckpt, 3)
    assert sorted(p.name for p in ckpt.iterdir()) == ["0", "2"]
    assert sorted(p.name for p in aside.iterdir()) == ["4", "6.orbax-checkpoint-tmp-12"]
    assert (aside / "4" / "data").read_text() == "4"
    assert divergence.set_aside(ckpt, 3) is None
    (ckpt / "4").mkdir()  # a rollback's next attempt reaches step 4 again, maybe within the same second
    again = divergence.set_aside(ckpt, 3)
    assert again != aside and (again / "4").is_dir() and (aside / "4" / "data").read_text() == "4"
