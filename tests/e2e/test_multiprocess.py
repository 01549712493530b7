"""Two real processes on loopback: a benchmark reported once. A job's training across processes, expert
parallelism across them against MaxText's block, checkpoints and resumes run under SLURM in test_slurm_job.py."""

from __future__ import annotations

import json

import pytest
from conftest import run_processes

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


def test_two_process_bench_reports_once(tmp_path):
    out = tmp_path / "bench.json"
    results = run_processes(
        2,
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
        timeout=240,
    )
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert "step time" in results[0].stdout and "step time" not in results[1].stdout
    result = json.loads(out.read_text())
    assert result["devices"] == 2 and result["timed_steps"] == 2
    assert result["tokens_per_step"] == 2 * 64  # batch 1 per device x 64 tokens x 2 devices
