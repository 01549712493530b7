"""The data position of a checkpoint carried to another process count, on MaxText's own Grain transforms in this
process. Jobs that resume on another process count and layout train under SLURM in test_slurm_job.py.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import pytest

from maxtext_moe.run import data_position

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
    """Global batch 4 and records that fill a row each (documents trimmed to the sequence, as in the SLURM jobs
    of test_slurm_job.py): the job read (step + 1) x 4 records, and the new processes' batches hold the same
    records, step by step, as the uninterrupted run's; only their order within the batch differs."""
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
