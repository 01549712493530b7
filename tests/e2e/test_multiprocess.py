"""Two real processes on loopback: a benchmark reported once, and expert parallelism across processes (a job's
training, checkpoints and resume across processes run under SLURM in test_slurm_job.py)."""

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


def test_our_expert_parallelism_across_two_processes_trains_as_maxtexts_block(tmp_path):
    """EP2 with our block (one expert shard per process; the default exchange, XLA's all-to-all between the
    processes, and its adjoint) against MaxText's own block under FSDP2: same initial parameters and data,
    so the same losses. The same two-process layout trains on two H200s (docs/PERFORMANCE.md)."""

    def losses(name: str, *overrides: str) -> list[float]:
        results = run_processes(
            2, "train", *overrides, "steps=3", f"base_output_directory={tmp_path / name}", timeout=240
        )
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
