"""A job's life under a real SLURM (two fake nodes on this machine, two processes each): the batch script is
exactly what `maxtext-moe launch --slurm` prints, and it trains the tiny model with FSDP across four processes.

Faults are real: SIGKILL and SIGSTOP of one training process, a process that stops arriving at the step's
collectives (MAXTEXT_MOE_FAULT), SLURM's time-limit warning to the batch shell, and the requeue that follows.
Each one is checked against an uninterrupted job of the same recipe: the losses after every restart and resume
are the same.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import REPO, read_metrics, run_cli

from maxtext_moe.run import watchdog
from maxtext_moe.run.distributed import free_port

# Whole jobs of several attempts: the suite's per-test limit (900 s) is too short for them on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("slurm"), pytest.mark.timeout(2400)]

STEPS = 12
TRAIN = [
    "per_device_batch_size=1",
    "max_target_length=64",
    "base_num_decoder_layers=2",
    "mtp_num_layers=0",
    f"steps={STEPS}",
    "checkpoint_period=2",
    "log_period=100",
]
JOB_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if gone := slurm_cluster.missing():
        pytest.skip(f"SLURM is not installed ({', '.join(gone)} missing); scripts/setup-slurm.sh installs it")
    c = slurm_cluster.Cluster(Path(tempfile.mkdtemp(prefix="maxtext-moe-slurm-"))).start()
    yield c
    c.stop()
    shutil.rmtree(c.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    """What `launch` prints for the tiny recipe on 2 nodes x 2 processes, run from this checkout's venv."""
    r = run_cli(
        "launch", "deepseek3-tiny-cpu", "--slurm", "--nodes", "2", "--tasks-per-node", "2", "--runtime", "venv",
        "--venv", str(Path(os.sys.prefix)), "--max-restarts", "3", "ici_fsdp_parallelism=-1", cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    path = tmp_path_factory.mktemp("job") / "train.sbatch"
    path.write_text(r.stdout)
    return path


def _submit(cluster, script: Path, runs: Path, *overrides: str, **env: str) -> int:
    env = {"RUNS": str(runs), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PYTHONUNBUFFERED": "1", **env}
    return cluster.sbatch(script, *TRAIN, *overrides, env=env)


def _output(script: Path, job: int) -> str:
    path = script.parent / f"mtm-deepseek3-tiny-cpu-{job}.out"
    return path.read_text() if path.exists() else ""


def _losses(run: Path) -> dict[int, float]:
    return {s: m["learning/loss"] for s, m in read_metrics(run).items()}


def _records(run: Path) -> dict[int, watchdog.Record]:
    return {r.process: r for r in watchdog.read_records(run)}


def _wait_for(what, timeout: float, every: float = 0.2):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := what():
            return value
        time.sleep(every)
    raise TimeoutError(f"not reached in {timeout} s: {what.__doc__ or what}")


def _at_step(run: Path, attempt: int, step: int):
    def reached() -> dict[int, watchdog.Record] | None:
        recs = _records(run)
        ok = len(recs) == 4 and all(
            r.attempt == attempt and r.step is not None and r.step >= step for r in recs.values()
        )
        return recs if ok else None

    reached.__doc__ = f"every process of attempt {attempt} at step {step}"
    return reached


@pytest.fixture(scope="module")
def reference(cluster, script, tmp_path_factory) -> dict[int, float]:
    """An uninterrupted job's losses."""
    runs = tmp_path_factory.mktemp("reference")
    job = _submit(cluster, script, runs)
    state = cluster.wait(job, JOB_TIMEOUT_S)
    out = _output(script, job)
    assert state == "COMPLETED", out[-4000:]
    run = runs / "deepseek3-tiny-cpu"
    losses = _losses(run)
    assert sorted(losses) == list(range(STEPS)), out[-3000:]
    assert f"maxtext-moe job {job}: finished" in out
    # Process 0 alone prints the progress and writes the run folder's identity; each other one its own log.
    assert sum(line.startswith(f"step {STEPS:5d}/{STEPS}") for line in out.splitlines()) == 1
    assert json.loads((run / "maxtext-moe-run.json").read_text())["recipe"] == "deepseek3-tiny-cpu"
    assert all((run / f"maxtext.process-{k}.log").is_file() for k in (1, 2, 3))
    return losses


def test_lost_and_hung_processes_end_the_attempt_and_the_job_restarts_in_place(cluster, script, reference, tmp_path):
    """One job, four attempts in one allocation: process 2 SIGKILLed mid-step; process 1 SIGSTOPped; process 3
    stops arriving at the step's collectives (MAXTEXT_MOE_FAULT); then the job finishes with the reference's
    losses."""
    ref_losses = reference
    runs = tmp_path / "runs"
    run = runs / "deepseek3-tiny-cpu"
    hang_step = 9
    job = _submit(
        cluster, script, runs, "job.watchdog=30", MAXTEXT_MOE_FAULT=f"hang:process=3:step={hang_step}:attempt=2"
    )

    # A lost process: every other one is gone within SLURM's KillWait of the loss, and the job says which.
    recs = _wait_for(_at_step(run, 0, 3), JOB_TIMEOUT_S)
    victim = recs[2]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()
    _wait_for(lambda: not any(_alive(r.pid) for r in recs.values()), 60)
    lost_s = time.time() - killed
    assert lost_s < slurm_cluster.KILL_WAIT_S + 5

    # A stopped process: the others' watchdogs end the attempt and name it.
    recs = _wait_for(_at_step(run, 1, 5), JOB_TIMEOUT_S)
    os.kill(recs[1].pid, signal.SIGSTOP)
    stopped = time.time()
    verdict = _wait_for(lambda: [r for r in _records(run).values() if r.attempt == 1 and r.verdict], 120)
    stopped_s = min(r.updated for r in verdict) - stopped

    # A process that never arrives at the collectives of step 9 (attempt 2) is named by its step.
    _wait_for(_at_step(run, 3, hang_step + 1), JOB_TIMEOUT_S)
    state = cluster.wait(job, JOB_TIMEOUT_S)
    out = _output(script, job)
    assert state == "COMPLETED", out[-5000:]
    lines = [line for line in out.splitlines() if line.startswith(("maxtext-moe:", f"maxtext-moe job {job}"))]
    print("\n".join(lines))
    print(
        f"detection: SIGKILL -> every process gone in {lost_s:.1f} s; SIGSTOP -> watchdog verdict in {stopped_s:.1f} s"
    )
    host = victim.host
    assert f"maxtext-moe: lost: process 2 on {host} (pid {victim.pid}) killed by SIGKILL" in out
    assert "task 2: Killed" in out  # its supervisor ends as its trainer did, so SLURM says the same
    assert "maxtext-moe: hung: watchdog:" in out and "process 1 on" in out and "is silent: no heartbeat" in out
    assert f"process 3 on {host} (pid " in out and f"is still before step {hang_step} while" in out
    assert f"MAXTEXT_MOE_FAULT: process 3 stops before step {hang_step}" in out
    for n in (1, 2, 3):
        assert f"maxtext-moe job {job}: restart {n} of 3 in this allocation" in out
    assert "the last complete checkpoint is step" in out
    assert sorted(p.name for p in (run / "stacks").iterdir()) == [f"process-{i}.txt" for i in (0, 1, 2, 3)]
    assert "in before_step" in (run / "stacks" / "process-3.txt").read_text()  # where the injected hang waits
    assert stopped_s < 30 + 3 * watchdog.INTERVAL_S + 10
    losses = _losses(run)
    assert sorted(losses) == list(range(STEPS))
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def test_time_limit_warning_checkpoints_requeues_and_resumes(cluster, script, reference, tmp_path):
    """SLURM's warning before the time limit (--signal=B:USR1, sent here as SLURM sends it: to the batch shell
    only) reaches every process; each saves at the next step and stops; the job requeues itself, and its next
    run (SLURM_RESTART_COUNT 1, after the requeue hold) resumes with the same losses as the uninterrupted job."""
    ref_losses = reference
    runs = tmp_path / "runs"
    run = runs / "deepseek3-tiny-cpu"
    job = _submit(cluster, script, runs)
    _wait_for(_at_step(run, 0, 4), JOB_TIMEOUT_S)
    cluster.run("scancel", "-b", "--signal=USR1", str(job))
    _wait_for(lambda: "requeued to resume" in _output(script, job), 180)
    state = cluster.wait(job, JOB_TIMEOUT_S)
    out = _output(script, job)
    assert state == "COMPLETED", out[-5000:] + cluster.log_tail()
    assert "time limit near: every process saves a checkpoint at the next step" in out
    assert "maxtext-moe: stopped: every process saved a checkpoint" in out
    assert "requeued to resume" in out and "(restart count 1)" in out
    exits = [json.loads(p.read_text()) for p in (run / "processes").glob("exit-*.json")]
    assert len(exits) == 4 and all(e["status"] == 0 for e in exits)
    resumed = [line for line in out.splitlines() if "resuming from step" in line]
    assert len(resumed) == 1, out[-3000:]
    losses = _losses(run)
    assert sorted(losses) == list(range(STEPS))
    assert losses == pytest.approx(ref_losses, rel=1e-5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
