"""A job's life under a real SLURM (two fake nodes on this machine, two processes each): the batch script is
exactly what `maxtext-moe launch --slurm` prints, and it trains the tiny model with FSDP across four processes.

Faults are real: SIGKILL and SIGSTOP of one training process, a process that stops arriving at the step's
collectives (MAXTEXT_MOE_FAULT), SLURM's time-limit warning to the batch shell, and the requeue that follows.
A checkpoint also resumes as a job of another process count and parallel layout. Each one is checked against an
uninterrupted job of the same recipe: the losses after every restart and resume are the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import slurm_cluster
from conftest import REPO, read_metrics, run_cli, run_processes

from maxtext_moe.run import data_position, watchdog
from maxtext_moe.run.distributed import free_port

# Whole jobs of several attempts: the suite's per-test limit (900 s) is too short for them on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

RECIPE = "deepseek3-tiny-cpu"
STEPS = 12
TRAIN = [
    "per_device_batch_size=1",  # a global batch of 4 sequences on either layout below
    "max_target_length=64",
    "base_num_decoder_layers=2",
    "mtp_num_layers=0",
    f"steps={STEPS}",
    f"learning_rate_schedule_steps={STEPS}",  # a job that stops earlier on purpose keeps the schedule
    "checkpoint_period=2",
    "log_period=100",
]
JOB_TIMEOUT_S = 600
# Jobs of another layout agree to float rounding: each step's global batch holds the same records on either
# process count (a record fills its row), in another order.
REL = 1e-5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if gone := slurm_cluster.missing():
        pytest.skip(f"SLURM is not installed ({', '.join(gone)} missing); scripts/setup-slurm.sh installs it")
    c = slurm_cluster.Cluster(Path(tempfile.mkdtemp(prefix="maxtext-moe-slurm-"))).start()
    yield c
    c.stop()
    shutil.rmtree(c.dir, ignore_errors=True)


def _launch(folder: Path, *args: str) -> Path:
    """What `launch --slurm` prints for the tiny recipe on 2 nodes, run from this checkout's venv."""
    r = run_cli(
        "launch", RECIPE, "--slurm", "--nodes", "2", "--runtime", "venv", "--venv", str(Path(os.sys.prefix)), *args,
        cwd=REPO,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    path = folder / "train.sbatch"
    path.write_text(r.stdout)
    return path


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    """2 nodes x 2 processes of 1 CPU device, FSDP across the four."""
    return _launch(
        tmp_path_factory.mktemp("job"), "--tasks-per-node", "2", "--max-restarts", "3", "ici_fsdp_parallelism=-1"
    )


@pytest.fixture(scope="module")
def expert_parallel_script(tmp_path_factory) -> Path:
    """2 nodes x 1 process of 2 CPU devices, our block with its experts split over the four devices."""
    return _launch(tmp_path_factory.mktemp("job-ep"), "topology.gpus_per_node=2", *EP)


def _submit(cluster, script: Path, runs: Path, *overrides: str, **env: str) -> int:
    env = {"RUNS": str(runs), "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "PYTHONUNBUFFERED": "1", **env}
    return cluster.sbatch(script, *TRAIN, *overrides, env=env)


def _output(script: Path, job: int) -> str:
    path = script.parent / f"mtm-{RECIPE}-{job}.out"
    return path.read_text() if path.exists() else ""


def _losses(run: Path) -> dict[int, float]:
    return {s: m["learning/loss"] for s, m in read_metrics(run).items()}


def _records(run: Path) -> dict[int, watchdog.Record]:
    """Every process's latest heartbeat, whichever launch wrote it."""
    records = [json.loads(p.read_text()) for p in (run / watchdog.PROCESSES).glob("process-*.json")]
    return {r["process"]: watchdog.Record(**r) for r in records}


def _wait_for(what, timeout: float, every: float = 0.2, job: tuple | None = None):
    """`what()` once it is truthy. On a timeout, given `job` (cluster, script, id), the message holds the job's
    state, the nodes' states and the end of its output: a job that never started, one that stalled and one
    that restarted look alike from the heartbeats alone."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if value := what():
            return value
        time.sleep(every)
    why = ""
    if job:
        cluster, script, job_id = job
        nodes = cluster.run("sinfo", "-h", "-N", "-o", "%N %T %E", check=False).stdout
        why = f"\njob {job_id}: {cluster.state(job_id)}; nodes:\n{nodes}{_output(script, job_id)[-3000:]}"
        why += cluster.log_tail()
    raise TimeoutError(f"not reached in {timeout} s: {what.__doc__ or what}{why}")


def _at_step(run: Path, attempt: int, step: int):
    def reached() -> dict[int, watchdog.Record] | None:
        recs = _records(run)
        ok = len(recs) == 4 and all(
            r.attempt == attempt and r.step is not None and r.step >= step for r in recs.values()
        )
        return recs if ok else None

    reached.__doc__ = f"every process of attempt {attempt} at step {step}"
    return reached


def _finished(cluster, script: Path, job: int) -> str:
    """The job's output, once it completed."""
    state = cluster.wait(job, JOB_TIMEOUT_S)
    out = _output(script, job)
    assert state == "COMPLETED", out[-5000:] + cluster.log_tail()
    return out


@pytest.fixture(scope="module")
def reference(cluster, script, tmp_path_factory) -> tuple[dict[int, float], Path]:
    """An uninterrupted job's losses, and its output folder."""
    runs = tmp_path_factory.mktemp("reference")
    job = _submit(cluster, script, runs)
    out = _finished(cluster, script, job)
    run = runs / RECIPE
    losses = _losses(run)
    assert sorted(losses) == list(range(STEPS)), out[-3000:]
    assert f"maxtext-moe job {job}: finished" in out
    # Process 0 alone prints the progress and writes the run folder's identity; each other one its own log.
    assert sum(line.startswith(f"step {STEPS:5d}/{STEPS}") for line in out.splitlines()) == 1
    assert json.loads((run / "maxtext-moe-run.json").read_text())["recipe"] == RECIPE
    assert all((run / f"maxtext.process-{k}.log").is_file() for k in (1, 2, 3))
    return losses, runs


def test_lost_and_hung_processes_end_the_attempt_and_the_job_restarts_in_place(cluster, script, reference, tmp_path):
    """One job, four attempts in one allocation: process 2 SIGKILLed mid-step; process 1 SIGSTOPped; process 3
    stops arriving at the step's collectives (MAXTEXT_MOE_FAULT); then the job finishes with the reference's
    losses."""
    ref_losses, _ = reference
    runs = tmp_path / "runs"
    run = runs / RECIPE
    hang_step = 9
    job = _submit(
        cluster, script, runs, "job.watchdog=30", MAXTEXT_MOE_FAULT=f"hang:process=3:step={hang_step}:attempt=2"
    )

    # A lost process: every other one is gone within SLURM's KillWait of the loss, and the job says which.
    recs = _wait_for(_at_step(run, 0, 3), JOB_TIMEOUT_S, job=(cluster, script, job))
    victim = recs[2]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.time()
    _wait_for(lambda: not any(_alive(r.pid) for r in recs.values()), 60)
    lost_s = time.time() - killed
    assert lost_s < slurm_cluster.KILL_WAIT_S + 5

    # A stopped process: the others' watchdogs end the attempt and name it.
    recs = _wait_for(_at_step(run, 1, 5), JOB_TIMEOUT_S, job=(cluster, script, job))
    os.kill(recs[1].pid, signal.SIGSTOP)
    stopped = time.time()
    verdict = _wait_for(lambda: [r for r in _records(run).values() if r.attempt == 1 and r.verdict], 120)
    stopped_s = min(r.updated for r in verdict) - stopped

    # A process that never arrives at the collectives of step 9 (attempt 2) is named by its step.
    _wait_for(_at_step(run, 3, hang_step + 1), JOB_TIMEOUT_S, job=(cluster, script, job))
    out = _finished(cluster, script, job)
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
    ref_losses, _ = reference
    runs = tmp_path / "runs"
    run = runs / RECIPE
    job = _submit(cluster, script, runs)
    _wait_for(_at_step(run, 0, 4), JOB_TIMEOUT_S, job=(cluster, script, job))
    cluster.run("scancel", "-b", "--signal=USR1", str(job))
    _wait_for(lambda: "requeued to resume" in _output(script, job), 180)
    out = _finished(cluster, script, job)
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


def test_a_checkpoint_resumes_as_a_job_of_another_process_count_and_layout(
    cluster, script, expert_parallel_script, reference, tmp_path
):
    """The uninterrupted job's checkpoint 4 (4 processes, FSDP) resumes as a job of 2 processes with our
    expert-parallel block (4 -> 2, FSDP -> EP) to step 8, whose checkpoint resumes as a job of 4 processes under
    FSDP again (2 -> 4, EP -> FSDP) to the end. Every resumed step's loss is the uninterrupted job's. A checkpoint
    that cannot go to the new layout is refused in one line before anything loads."""
    ref_losses, ref_runs = reference
    runs = _copy_until(ref_runs, tmp_path / "runs", 4)
    run = runs / RECIPE
    common = [*TRAIN, f"base_output_directory={runs}"]

    # Refused in one line, nothing written: a mesh that does not divide the experts or a weight (before jax
    # starts); a data position that cannot be re-sharded; another model (the run folder's identity), as a job,
    # which does not spend its restarts on the same error.
    before = sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()
    for mesh, words in [
        ("ici_expert_parallelism=-1", "ici_expert_parallelism: is 3, which does not divide num_experts=16"),
        ("ici_fsdp_parallelism=-1", "splits the weights' kv_lora dimension (kv_lora_rank=16) fsdp 3 = 3 ways"),
    ]:
        r = run_cli("train", RECIPE, "topology.nodes=3", mesh, *common, cwd=REPO, timeout=120)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    two = ["topology.nodes=2", "topology.gpus_per_node=2", *EP, *common, "grain_worker_count=1"]
    assert all(
        "the checkpoint at step 4 was written by 4 process(es), and its data position cannot be carried to 2: "
        "grain_worker_count is 1" in line
        for line in _refused(run_processes(2, "train", RECIPE, *two))
    )
    job = _submit(cluster, expert_parallel_script, runs, "num_experts=8")
    state, out = cluster.wait(job, JOB_TIMEOUT_S), _output(expert_parallel_script, job)
    assert state == "FAILED", out[-3000:]
    assert "with another model shape (num_experts: 16 -> 8)" in out
    # Process 0 refuses the folder; the other one, waiting on it, says so with status 2 too: either may end first.
    assert re.search(r"maxtext-moe: lost: process [01] on \S+ \(pid \d+\) exited with status 2;", out), out[-3000:]
    assert "not restarting: a restart would end on the same error" in out and "restart 1 of" not in out
    assert (sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()) == before

    # 4 -> 2 processes, FSDP -> expert parallelism: steps 5 to 8, on the records after the 5 steps' 5 x 4.
    job = _submit(cluster, expert_parallel_script, runs, "steps=9")
    out = _finished(cluster, expert_parallel_script, job)
    assert "resuming from step 5" in out
    assert "data: checkpoint 4 was written by 4 process(es) that had read 20 records of the shuffled corpus; " in out
    assert "this run's 2 process(es) go on from record 20" in out
    assert "moe.impl=ours: expert parallelism 4" in (run / "maxtext.log").read_text()
    assert _iter_states(run / "checkpoints" / "8") == {f"process_{i}-of-2.json": 18 for i in range(2)}
    resumed = _losses(run)
    assert [resumed[s] for s in range(5, 9)] == pytest.approx([ref_losses[s] for s in range(5, 9)], rel=REL)

    # 2 -> 4 processes, expert parallelism -> FSDP: steps 9 to 11.
    job = _submit(cluster, script, runs)
    out = _finished(cluster, script, job)
    assert "data: checkpoint 8 was written by 2 process(es) that had read 36 records" in out
    assert _iter_states(run / "checkpoints" / str(STEPS - 1)) == {f"process_{i}-of-4.json": 12 for i in range(4)}
    losses = _losses(run)
    assert sorted(losses) == list(range(STEPS))
    assert losses == pytest.approx(ref_losses, rel=REL)
    print(f"resumed on another layout: largest relative loss difference {_largest_rel(losses, ref_losses):.1e}")


EP = ["ici_expert_parallelism=-1", "moe.impl=ours", "moe.gemm=ragged_dot"]  # our block, 4 experts a device


def _copy_until(src: Path, dst: Path, step: int) -> Path:
    """The output folder `src` as it stood at checkpoint `step`: later checkpoints and metrics dropped."""
    shutil.copytree(src, dst)
    run = dst / RECIPE
    for ckpt in (run / "checkpoints").iterdir():
        if int(ckpt.name) > step:
            shutil.rmtree(ckpt)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= step))
    return dst


def _refused(results) -> list[str]:
    """Each process's one error line (and no traceback), for a command every process refused."""
    lines = []
    for i, r in enumerate(results):
        errors = [line for line in r.stderr.splitlines() if line.startswith("maxtext-moe: error:")]
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, f"process {i}:\n{r.stderr}"
        lines.append(errors[0])
    return lines


def _iter_states(step_dir: Path) -> dict[str, int]:
    return {f.name: data_position.source_index(json.loads(f.read_text())) for f in (step_dir / "iter").glob("*.json")}


def _largest_rel(losses: dict[int, float], ref: dict[int, float]) -> float:
    return max(abs(losses[s] - ref[s]) / abs(ref[s]) for s in ref)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
