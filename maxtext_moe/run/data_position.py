"""Carry a checkpoint's data position to another count of processes.

The gap: MaxText 0.2.5 saves Grain's iterator state per process (`<step>/iter/process_<i>-of-<n>.json`: the
position of process i in its shard, the records `i, i+n, i+2n, ...` of the shuffled corpus) and restores it
only onto the same count of processes. Another count stops the restore with an assertion that asks for
`expansion_factor_real_data`, which keeps the old count of data shards for the rest of the run (each process
runs several iterators, or some load none). Grain's `ElasticIterator`, which keeps one global position, takes
only map datasets without packing; MaxText's pretraining pipeline tokenizes and packs in an iterator dataset.
Orbax itself needs nothing: MaxText restores parameters and optimizer state onto the new mesh's shardings.

This module derives the global position from the stored states and gives each new process its start:

- the shuffled, repeated corpus is one sequence whatever the process count (`data_shuffle_seed` shuffles all
  records before they are sharded), so a position in it means the same record on any layout;
- process i of n had read `k_i` records of its shard (the innermost `next_index` of its state: the records of
  the packed rows it emitted), so the job had read `G = k_0 + ... + k_{n-1}` records, and when every `k_i` is the
  same (one record per packed row, as with `use_truncation: true` and documents longer than a sequence) it read
  exactly the positions `0 .. G-1`, `G` being (step + 1) x the global batch;
- new process p of m starts its shard `p, p+m, ...` at the first position at or after G, with the rest of its
  iterator state fresh. When the `k_i` differ, as many unread positions before G are skipped as read positions
  after G are read again (at most n x (max k - min k) of each), so the count of records consumed stays exact.

Not carried: the rows a packer builds (first-fit packing packs each process's own records, so rows depend on the
process count), the order of rows within a packed batch (Grain shuffles them with a seed counted from the rows
that process emitted; a re-sharded process counts from 0), and a document cut into several sequences
(`use_truncation: false`) that a process was in the middle of: it is read again from its start.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.run import distributed, run_dir

ITER = "iter"  # MaxText's checkpoint item for the data iterator
_STATE_FILE = re.compile(r"process_(\d+)-of-(\d+)\.json")
_FIX = "resume on {n} process(es) (topology.nodes={n} on the CPU), or start a new run_name on this layout."


@dataclass(frozen=True)
class Stored:
    """The data position of one checkpoint: each process's count of records read in its shard."""

    step: int
    read: tuple[int, ...]  # k_i: records process i had read of its shard i, i+n, ...

    @property
    def processes(self) -> int:
        return len(self.read)

    @property
    def consumed(self) -> int:
        """G: the records the job had read, the position the next process layout starts at."""
        return sum(self.read)

    def start(self, process: int, processes: int) -> int:
        """The first record of shard `process` of `processes` at or after position G, as an index in that shard."""
        return max(0, -(-(self.consumed - process) // processes))


def source_index(state: Any) -> int:
    """The innermost `next_index` of a Grain iterator state: `{"parent": ... {"next_index": k}}`, the state of
    `to_iter_dataset` over the sharded map dataset under each single-parent stage (maps, packing, flat-map)."""
    node = state
    while isinstance(node, dict) and "parent" in node:
        node = node["parent"]
    if not (isinstance(node, dict) and isinstance(node.get("next_index"), int)):
        raise ValueError(f"no record position in the Grain state {json.dumps(state)[:200]}")
    return node["next_index"]


def with_source_index(state: dict[str, Any], index: int) -> dict[str, Any]:
    """`state` with its innermost `next_index` set to `index` (the rest as given)."""
    if "parent" in state:
        return dict(state, parent=with_source_index(state["parent"], index))
    source_index(state)  # raises for a state without a record position
    return dict(state, next_index=index)


def _unreadable(step_dir: Path, why: str) -> UserError:
    return UserError(
        f"the data position in {step_dir / ITER} cannot be carried to another count of processes: {why}.",
        fix="resume on the process count that wrote it, or move that checkpoint aside to resume from an earlier one.",
    )


def _state_files(step_dir: Path) -> list[Path]:
    """The per-process Grain states of the checkpoint in `step_dir`, by process index (empty: none, as with
    synthetic data or Grain's `ElasticIterator`, whose one global state MaxText restores on any count)."""
    files = {m: p for p in (step_dir / ITER).glob("process_*-of-*.json") if (m := _STATE_FILE.fullmatch(p.name))}
    if not files:
        return []
    counts = {int(m.group(2)) for m in files}
    if len(counts) > 1:
        raise _unreadable(step_dir, f"it holds states of {sorted(counts)} processes")
    n = counts.pop()
    by_index = {int(m.group(1)): p for m, p in files.items()}
    if sorted(by_index) != list(range(n)):
        missing = sorted(set(range(n)) - set(by_index))
        raise _unreadable(step_dir, f"the states of process(es) {missing} of {n} are missing")
    return [by_index[i] for i in range(n)]


def written_by(step_dir: Path) -> int | None:
    """The count of processes whose Grain states the checkpoint in `step_dir` holds; None when it holds none."""
    return len(_state_files(step_dir)) or None


def read(step_dir: Path) -> Stored | None:
    """The data position of the checkpoint in `step_dir`; None when it holds no per-process Grain states."""
    files = _state_files(step_dir)
    if not files:
        return None
    read_counts = []
    for f in files:
        try:
            read_counts.append(source_index(json.loads(f.read_text())))
        except (ValueError, OSError, UnicodeDecodeError) as e:
            raise _unreadable(
                step_dir, f"{f.name} is not the state of a single-stream Grain pipeline ({' '.join(str(e).split())})"
            ) from None
    return Stored(int(step_dir.name), tuple(read_counts))


def unsupported(value: Callable[[str], Any]) -> str | None:
    """Why this recipe's Grain pipeline cannot start from a global position (None: it can). MaxText shards
    ArrayRecord records by position; other file types by file, mixtures per component, and worker processes
    keep one state each."""
    if str(value("grain_file_type")) != "arrayrecord":
        return f"grain_file_type is {value('grain_file_type')}, whose files are sharded by file, not by record"
    if ";" in str(value("grain_train_files") or "") or value("grain_train_mixture_config_path"):
        return "the corpus is a mixture, whose components keep a position each"
    if int(value("grain_worker_count")) != 0:
        return f"grain_worker_count is {value('grain_worker_count')}, and Grain's workers keep a position each"
    if float(value("expansion_factor_real_data")) not in (-1.0, 1.0):
        return "expansion_factor_real_data is set, which shards the data over some of the processes"
    if value("colocated_python_data_input"):
        return "colocated_python_data_input reads the data outside these processes"
    return None


def check(
    value: Callable[[str], Any],
    checkpoints: Path,
    found: run_dir.Checkpoints,
    proc: distributed.ProcessSpec,
    *,
    log: Callable[[str], None] = print,
) -> Stored | None:
    """Before MaxText loads anything: the latest checkpoint's data position, when it was written by another
    count of processes and this run's pipeline can take it (the line `log` gets says where the data goes on);
    None when MaxText restores it itself. Raises UserError when the position cannot be carried."""
    if found.latest is None or found.latest + 1 >= int(value("steps")) or str(value("dataset_type")) != "grain":
        return None  # nothing to restore, nothing left to train, or no Grain position in the checkpoints
    step_dir = checkpoints / str(found.latest)
    writers = written_by(step_dir)
    if writers is None or writers == proc.num_processes:
        return None  # MaxText restores each process's own state
    if why := unsupported(value):
        raise UserError(
            f"the checkpoint at step {found.latest} was written by {writers} process(es), and its data "
            f"position cannot be carried to {proc.num_processes}: {why}.",
            fix=_FIX.format(n=writers),
        )
    stored = read(step_dir)
    assert stored is not None
    log(
        f"data: checkpoint {found.latest} was written by {stored.processes} process(es) that had read "
        f"{stored.consumed} records of the shuffled corpus; this run's {proc.num_processes} process(es) go on "
        f"from record {stored.consumed}"
        + ("" if len(set(stored.read)) == 1 else f" (they had read {min(stored.read)} to {max(stored.read)} each)")
    )
    return stored


@dataclass
class _Resharded:
    """Orbax's `StatefulCheckpointable` for the restore of a checkpoint written by another count of processes:
    it sets this process's Grain iterator to its start in the new sharding instead of reading its own file."""

    iterator: Any
    stored: Stored
    process: int
    processes: int

    async def save(self, directory: Any) -> Any:
        raise NotImplementedError("a re-sharded data position is only restored; saves use MaxText's own")

    async def load(self, directory: Any) -> Any:
        try:
            state = with_source_index(self.iterator.get_state(), self.stored.start(self.process, self.processes))
        except ValueError as e:
            why = f"this run's Grain pipeline has no single stream ({e})"
            raise _unreadable(Path(str(directory)).parent, why) from None

        async def _set() -> None:
            self.iterator.set_state(state)

        return _set()


def install() -> None:
    """From now on in this process, a Grain restore from a checkpoint of another process count starts each
    process at its share of the global position (MaxText's own restore for the same count, unchanged)."""
    import jax
    from maxtext.common import checkpointing, grain_utility

    original = getattr(grain_utility.for_restore, "maxtext_original", grain_utility.for_restore)

    def for_restore(checkpoint_manager: Any, step: int, data_iterator: Any, expansion_factor_real_data: int) -> Any:
        step_dir = Path(str(checkpoint_manager.directory)) / str(step)
        iterator = getattr(data_iterator, "local_iterator", data_iterator)
        if (
            written_by(step_dir) in (None, jax.process_count())
            or isinstance(data_iterator, list)
            or not hasattr(iterator, "set_state")
        ):
            return original(checkpoint_manager, step, data_iterator, expansion_factor_real_data)
        stored = read(step_dir)
        assert stored is not None
        return _Resharded(iterator, stored, jax.process_index(), jax.process_count())

    for_restore.maxtext_original = original  # type: ignore[attr-defined]
    grain_utility.for_restore = for_restore
    assert checkpointing.grain_utility is grain_utility  # MaxText calls it through the module
