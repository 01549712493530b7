"""A checkpoint resumes on another process count and another parallel layout, with the uninterrupted run's losses.

The fast test drives MaxText's own Grain transforms in this process; the slow one trains real CPU processes on
loopback (one process per `topology.nodes`, `topology.gpus_per_node` CPU devices each), as test_multiprocess.py.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, run_processes

from maxtext_moe.run import data_position

RUN = "deepseek3-tiny-cpu"
# test_multiprocess.py's shrink with the process count left to each run: a global batch of 4 sequences of 64 tokens.
SHRINK = [
    "per_device_batch_size=1",
    "max_target_length=64",
    "checkpoint_period=2",
    "base_num_decoder_layers=2",
    "mtp_num_layers=0",
    "learning_rate_schedule_steps=6",
]
FOUR = ["topology.nodes=4", "topology.gpus_per_node=1"]  # 4 processes of 1 CPU device
TWO = ["topology.nodes=2", "topology.gpus_per_node=2"]  # 2 processes of 2 CPU devices
FSDP = ["ici_fsdp_parallelism=-1"]  # MaxText's MoE block, experts sharded by FSDP
EP = ["ici_expert_parallelism=-1", "moe.impl=ours", "moe.gemm=ragged_dot"]  # our block, 4 experts a device
# The runs agree to float rounding: each step's global batch holds the same records on either process count (a
# record fills its row), in another order. Measured on the resumed steps 3, 4, 5: 0, 9.5e-7 (relative 9e-8), 0.
REL = 1e-5


# -- MaxText's Grain pipeline in this process --------------------------------------------------------------------

SEQ = 8  # max_target_length of the pipeline below


def _records(lengths: list[int]) -> list[dict[str, np.ndarray]]:
    """Pre-tokenized records whose tokens name them: record r is `lengths[r]` tokens of r + 1."""
    return [
        {"inputs": np.full(n, r + 1, np.int32), "targets": np.full(n, r + 1, np.int32)} for r, n in enumerate(lengths)
    ]


def _iterator(records: list[dict], process: int, processes: int, rows: int):
    """MaxText's pretraining transforms after tokenizing: shuffle (seed 0), shard by record, first-fit packing
    into `rows` rows, batch (`grain_data_processing._apply_mapdataset_transforms`, `format_and_batch`)."""
    import grain
    from maxtext.input_pipeline import data_processing_utils, grain_data_processing

    config = types.SimpleNamespace(
        packing=True,
        max_target_length=SEQ,
        max_segments_per_seq=-1,
        grain_packing_type="first_fit",
        grain_use_elastic_iterator=False,
        add_bos=False,
    )
    ds = grain_data_processing._apply_mapdataset_transforms(
        grain.MapDataset.source(records), True, 0, 1, process, processes, 1, 1
    )
    return iter(data_processing_utils.format_and_batch(ds, config, rows, 0, ("inputs", "targets"), None))


def _step(iterators: list) -> set[int]:
    """The records in one global batch: each process's local batch."""
    seen: set[int] = set()
    for it in iterators:
        seen |= {int(v) - 1 for v in np.unique(next(it)["inputs"]) if v}
    return seen


def _save(iterators: list, step_dir: Path) -> None:
    """The iterator states as MaxText's checkpoint writes them (`<step>/iter/process_<i>-of-<n>.json`)."""
    (step_dir / "iter").mkdir(parents=True)
    for i, it in enumerate(iterators):
        (step_dir / "iter" / f"process_{i}-of-{len(iterators)}.json").write_text(json.dumps(it.get_state()))


def _resume(records: list[dict], stored: data_position.Stored, processes: int, rows: int) -> list:
    """Fresh iterators of another process count, each set to its start as `data_position` sets it on restore."""
    iterators = [_iterator(records, p, processes, rows) for p in range(processes)]
    for p, it in enumerate(iterators):
        it.set_state(data_position.with_source_index(it.get_state(), stored.start(p, processes)))
    return iterators


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_a_grain_position_goes_on_with_the_same_records_on_another_process_count(tmp_path, before, after):
    """Global batch 4 and records that fill a row each (documents trimmed to the sequence, as in the
    slow test below): the job read (step + 1) x 4 records, and the new processes' batches hold the same records, step by
    step, as the uninterrupted run's; only their order within the batch differs."""
    records = _records([SEQ] * 64)
    uninterrupted = [_iterator(records, i, before, 4 // before) for i in range(before)]
    expected = [_step(uninterrupted) for _ in range(6)]
    stopped = [_iterator(records, i, before, 4 // before) for i in range(before)]
    for _ in range(3):
        _step(stopped)
    _save(stopped, tmp_path / "2")
    stored = data_position.read(tmp_path / "2")
    assert stored is not None and stored.processes == before and stored.consumed == 3 * 4
    resumed = _resume(records, stored, after, 4 // after)
    assert [_step(resumed) for _ in range(3)] == expected[3:]


def test_when_processes_read_unequal_counts_the_count_consumed_stays_exact(tmp_path):
    """Records of 2 to 8 tokens, several to a packed row: the four processes had read different counts. The two
    new processes read every position from G = their sum on, and as many positions before G are skipped as
    positions after G are read again."""
    lengths = [int(n) for n in np.random.default_rng(0).integers(2, SEQ + 1, 400)]
    records = _records(lengths)
    order = [int(r) for r in _iterator_order(len(records))]
    stopped = [_iterator(records, i, 4, 1) for i in range(4)]
    before: set[int] = set()
    for _ in range(5):
        before |= _step(stopped)
    _save(stopped, tmp_path / "4")
    stored = data_position.read(tmp_path / "4")
    assert stored is not None and len(set(stored.read)) > 1  # the case this test is for
    g = stored.consumed
    after: set[int] = set()
    resumed = _resume(records, stored, 2, 2)
    for _ in range(12):
        after |= _step(resumed)
    position = {r: i for i, r in enumerate(order)}
    read_after = {position[r] for r in after}
    # each new process read at least 12 steps x 2 rows of its shard, a record or more a row, from G on
    assert min(read_after) == g and set(range(g, g + 2 * 24)) <= read_after
    skipped = [p for p in range(g) if order[p] not in before]
    again = [position[r] for r in before if position[r] >= g]
    assert len(skipped) == len(again) > 0
    assert len(skipped) <= 4 * (max(stored.read) - min(stored.read))


def _iterator_order(n: int) -> list[int]:
    """The shuffled order of n records, as MaxText's `data_shuffle_seed: 0` gives it on any process count."""
    import grain

    return list(grain.MapDataset.source(list(range(n))).shuffle(seed=0))


def test_a_grain_state_without_a_record_position_is_refused_in_one_line(tmp_path):
    """The states Grain's worker processes save (`grain_worker_count` > 0) keep one position per worker."""
    (tmp_path / "2" / "iter").mkdir(parents=True)
    for i in range(2):
        state = {"workers_state": {"0": {"parent": {"next_index": 3}}}, "iterations_to_skip": {"0": 0}}
        (tmp_path / "2" / "iter" / f"process_{i}-of-2.json").write_text(json.dumps(state))
    with pytest.raises(data_position.UserError, match="process_0-of-2.json is not the state of a single-stream"):
        data_position.read(tmp_path / "2")
    (tmp_path / "2" / "iter" / "process_1-of-2.json").unlink()
    with pytest.raises(data_position.UserError, match=r"the states of process\(es\) \[1\] of 2 are missing"):
        data_position.read(tmp_path / "2")


# -- real training processes -------------------------------------------------------------------------------------


def _train(out: Path, layout: list[str], steps: int, *more: str) -> str:
    """Train on `layout` to `steps`; process 0's terminal output."""
    n = int(layout[0].split("=")[1])
    results = run_processes(n, "train", RUN, *layout, *SHRINK, f"steps={steps}", f"base_output_directory={out}", *more)
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return results[0].stdout


def _refused(results: list[subprocess.CompletedProcess]) -> list[str]:
    """Each process's one error line (and no traceback), for a command every process refused."""
    lines = []
    for i, r in enumerate(results):
        errors = [line for line in r.stderr.splitlines() if line.startswith("maxtext-moe: error:")]
        assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, f"process {i}:\n{r.stderr}"
        lines.append(errors[0])
    return lines


def _losses(run: Path) -> dict[int, float]:
    return {
        int(d["step"]): d["learning/loss"] for d in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    }


def _iter_states(step_dir: Path) -> dict[str, int]:
    return {f.name: data_position.source_index(json.loads(f.read_text())) for f in (step_dir / "iter").glob("*.json")}


def _copy_until(src: Path, dst: Path, step: int) -> Path:
    """The output folder `src` (corpus and run) as it stood at checkpoint `step`: later checkpoints and metrics
    dropped."""
    shutil.copytree(src, dst)
    run = dst / RUN
    for ckpt in (run / "checkpoints").iterdir():
        if int(ckpt.name) > step:
            shutil.rmtree(ckpt)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] <= step))
    return run


@pytest.mark.slow
def test_two_processes_resume_on_four_with_expert_parallelism_and_back_with_the_uninterrupted_losses(tmp_path):
    """One uninterrupted run of 2 processes under FSDP to step 6. Its checkpoint 2 resumes on 4 processes with
    our expert-parallel block (2 -> 4, FSDP -> EP), whose checkpoint 4 resumes on 2 processes under FSDP again
    (4 -> 2, EP -> FSDP). Every resumed step's loss is the uninterrupted run's. Layouts that cannot take the
    checkpoint are refused in one line before anything loads."""
    reference = tmp_path / "reference"
    _train(reference, TWO + FSDP, 6)
    expected = _losses(reference / RUN)
    assert sorted(expected) == [0, 1, 2, 3, 4, 5]
    run = _copy_until(reference, tmp_path / "resumed", 2)
    out = run.parent
    common = [*SHRINK, "steps=6", f"base_output_directory={out}"]

    # Refused in one line, nothing written: a mesh that does not divide the experts or a weight (before jax
    # starts), another model (the run folder's identity).
    before = sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()
    for mesh, words in [
        ("ici_expert_parallelism=-1", "ici_expert_parallelism: is 3, which does not divide num_experts=16"),
        ("ici_fsdp_parallelism=-1", "splits the weights' kv_lora dimension (kv_lora_rank=16) fsdp 3 = 3 ways"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "maxtext_moe", "train", RUN, "topology.nodes=3", mesh, *common],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr
    other_model = _refused(run_processes(2, "train", RUN, *TWO, *FSDP, *common, "num_experts=8"))
    assert "with another model shape (num_experts: 16 -> 8)" in other_model[0]
    assert (sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()) == before

    # 2 -> 4 processes, FSDP -> expert parallelism: steps 3 and 4 on the records after the 3 steps' 3 x 4.
    stdout = _train(out, FOUR + EP, 5)
    assert "resuming from step 3" in stdout
    assert "data: checkpoint 2 was written by 2 process(es) that had read 12 records of the shuffled corpus; " in stdout
    assert "this run's 4 process(es) go on from record 12" in stdout
    assert "moe.impl=ours: expert parallelism 4" in (run / "maxtext.log").read_text()
    assert _iter_states(run / "checkpoints" / "4") == {f"process_{i}-of-4.json": 5 for i in range(4)}
    resumed = _losses(run)
    assert [resumed[s] for s in (3, 4)] == pytest.approx([expected[s] for s in (3, 4)], rel=REL)

    # A data pipeline whose position cannot be re-sharded: one line from each process, before MaxText loads.
    before = sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()
    workers = _refused(run_processes(2, "train", RUN, *TWO, *FSDP, *common, "grain_worker_count=1"))
    assert all(
        "the checkpoint at step 4 was written by 4 process(es), and its data position cannot be carried to 2: "
        "grain_worker_count is 1" in line
        for line in workers
    )
    assert (sorted((run / "checkpoints").iterdir()), (run / "metrics.jsonl").read_text()) == before

    # 4 -> 2 processes, expert parallelism -> FSDP: step 5.
    stdout = _train(out, TWO + FSDP, 6)
    assert "data: checkpoint 4 was written by 4 process(es) that had read 20 records" in stdout
    assert _iter_states(run / "checkpoints" / "5") == {f"process_{i}-of-2.json": 12 for i in range(2)}
    assert _losses(run)[5] == pytest.approx(expected[5], rel=REL)
