"""Two real training processes on loopback: jax.distributed, shared run folder, checkpoints, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from maxtext_moe.run.distributed import free_port

pytestmark = pytest.mark.slow

# Two CPU processes of one device each; the single-device fragment's fsdp=1 becomes "all devices".
SHRINK = [
    "topology.nodes=2",
    "ici_fsdp_parallelism=-1",
    "per_device_batch_size=1",
    "max_target_length=64",
    "checkpoint_period=2",
    "base_num_decoder_layers=2",
    "mtp_num_layers=0",
]


def _train_two(out: Path, steps: int, *more: str) -> list[subprocess.CompletedProcess]:
    return _two("train", *SHRINK, f"steps={steps}", f"base_output_directory={out}", *more)


def _two(*args: str) -> list[subprocess.CompletedProcess]:
    """`python -m maxtext_moe ARGS` as processes 0 and 1 of one job on loopback."""
    port = free_port()
    procs = []
    for pid in range(2):
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(pid),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "maxtext_moe", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


def test_two_processes_train_checkpoint_and_resume(tmp_path):
    out = tmp_path / "out"
    run = out / "deepseek3-tiny-cpu"
    first = _train_two(out, steps=4)
    for i, r in enumerate(first):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "starting from scratch, training to step 4" in first[0].stdout
    # Only process 0 prints progress, writes the metrics file and the run-folder identity.
    assert "step     4/4" in first[0].stdout and "step " not in first[1].stdout
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert json.loads((run / "maxtext-moe-run.json").read_text())["recipe"] == "deepseek3-tiny-cpu"
    assert (run / "maxtext.process-1.log").is_file()
    ckpts = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert ckpts == [0, 2, 3]
    assert all((run / "checkpoints" / str(s) / "_CHECKPOINT_METADATA").is_file() for s in ckpts)

    second = _train_two(out, 6, "learning_rate_schedule_steps=6")  # a longer schedule, on purpose
    for i, r in enumerate(second):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "resuming from step 4, training to step 6" in second[0].stdout
    resumed = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][4:]
    assert resumed and min(resumed) == 4 and max(resumed) == 5
    assert (run / "checkpoints" / "5" / "_CHECKPOINT_METADATA").is_file()


def test_two_process_bench_reports_once(tmp_path):
    out = tmp_path / "bench.json"
    results = _two(
        "bench",
        "deepseek3-tiny-cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
        *SHRINK,
        f"base_output_directory={tmp_path}",
    )
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "step time" in results[0].stdout and "step time" not in results[1].stdout
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and result["timed_steps"] == 2
    assert result["tokens_per_step"] == 2 * 64  # batch 1 per device x 64 tokens x 2 devices


def test_our_expert_parallelism_across_two_processes_trains_as_maxtexts_block(tmp_path):
    """EP2 with our block (one expert shard per process; the default exchange, XLA's all-to-all between the
    processes, and its adjoint) against MaxText's own block under FSDP2: same initial parameters and data,
    so the same losses. The same two-process layout trains on two H200s (docs/PERFORMANCE.md)."""

    def losses(name: str, *overrides: str) -> list[float]:
        results = _two("train", *overrides, "steps=3", f"base_output_directory={tmp_path / name}")
        for i, r in enumerate(results):
            assert r.returncode == 0, f"{name} process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        run = tmp_path / name / "deepseek3-tiny-cpu"
        return [json.loads(line)["learning/loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    ep_shrink = [a for a in SHRINK if not a.startswith("ici_fsdp_parallelism")]
    ours = losses("ep2", *ep_shrink, "ici_expert_parallelism=-1", "moe.impl=ours", "moe.gemm=ragged_dot")
    log = (tmp_path / "ep2" / "deepseek3-tiny-cpu" / "maxtext.log").read_text()
    assert "moe.impl=ours: expert parallelism 2 (exchange all_to_all" in log
    reference = losses("fsdp2", *SHRINK, "moe.impl=maxtext")
    assert len(ours) == len(reference) == 3
    assert ours == pytest.approx(reference, rel=1e-5)
