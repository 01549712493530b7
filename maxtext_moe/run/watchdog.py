"""Each process's heartbeat in the run folder, and the watchdog that ends a process whose steps stopped.

The gap: in a job of many processes, one that stops (SIGSTOP, a stuck driver, a dead NFS mount) or stops
arriving at a collective leaves every other one waiting inside that collective, and JAX's coordination
service only notices a process that is gone, not one that is alive and silent. Each process here writes
`<run>/processes/process-K.json` (host, pid, the step it started, when) from a thread, and the same thread
ends the process when no step has started for the recipe's `job.watchdog` timeout: it writes every thread's
Python stack (`faulthandler`) to `<run>/stacks/process-K.txt` (as every process does when the launcher then
ends it with SIGTERM), names the silent process from the others'
records in one line, and exits with `STALLED` so that the launcher (`srun --kill-on-bad-exit`, the Kubernetes
pod script) ends the job and its restart loop starts it again.

Every record names its launch (`launch_id`): the SLURM job, its requeue count and the attempt within it. A run
folder outlives its launches (a restart, a requeue, a job of another layout resuming it), and a record another
launch left, such as process 3's after a job of four processes when two now run, says nothing of this one; the
readers skip them.

`MAXTEXT_MOE_FAULT=hang:process=K:step=N[:attempt=A]` makes process K stop before step N (of restart A of the
job, `MAXTEXT_MOE_ATTEMPT`), while its heartbeat goes on: a rehearsal of a process that never arrives at a
collective, for testing a cluster's fault handling before a real run meets one.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.job import JobSettings

STALLED = 3  # exit status of a process the watchdog ended
PROCESSES = "processes"
STACKS = "stacks"
FAULT_VAR = "MAXTEXT_MOE_FAULT"
ATTEMPT_VAR = "MAXTEXT_MOE_ATTEMPT"
LAUNCHED_VAR = "MAXTEXT_MOE_LAUNCHED"
INTERVAL_S = 2.0
SILENT_AFTER_S = 4 * INTERVAL_S  # a record older than this: the process (or its host) is not running
LAUNCH_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", ATTEMPT_VAR)


def launch_id() -> str:
    """This launch of the run: job/requeue/attempt from the launcher's variables ("-" for one it does not set).
    The job script's shell, which runs `report`, and its processes see the same values."""
    return "/".join(os.environ.get(v) or "-" for v in LAUNCH_VARS)


@dataclass
class Record:
    process: int
    host: str
    pid: int
    attempt: int
    step: int | None  # the last step this process started; None before the first
    step_started: float | None
    updated: float
    launched: float | None = None  # when the launcher started this task (its supervisor), for time to first step
    verdict: str | None = None
    launch: str = ""  # launch_id() of the process that wrote it


def record_path(run: Path, process: int) -> Path:
    return run / PROCESSES / f"process-{process}.json"


def read_json(run: Path, pattern: str, launch: str) -> list[dict]:
    """The records of `launch` in <run>/processes matching `pattern`; unreadable (half-written) files are
    skipped."""
    out = []
    for path in sorted((run / PROCESSES).glob(pattern)):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("launch") == launch:
            out.append(data)
    return out


def read_records(run: Path, launch: str) -> list[Record]:
    """Every process's latest heartbeat record of `launch`, by process number."""
    records = []
    for data in read_json(run, "process-*.json", launch):
        try:
            records.append(Record(**data))
        except TypeError:
            continue
    return sorted(records, key=lambda r: r.process)


def write_json(path: Path, data: dict) -> None:
    """Replace `path` whole: a reader on another node never sees half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")  # one per writer
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def silent(records: list[Record], now: float) -> tuple[Record | None, str]:
    """The process the others are waiting for, and why: no heartbeat (stopped, or its host gone), else the
    lowest step when some process has started a later one; (None, reason) when every process is alive at one
    step (a collective, the network or the filesystem hangs them all)."""
    stale = [r for r in records if now - r.updated > SILENT_AFTER_S]
    if stale:
        r = min(stale, key=lambda r: r.updated)
        return r, f"no heartbeat for {now - r.updated:.0f} s (stopped, or its host is gone)"
    steps = [r.step if r.step is not None else -1 for r in records]
    if steps and min(steps) < max(steps):
        r = min(records, key=lambda r: r.step if r.step is not None else -1)
        started = "has not started a step" if r.step is None else f"is still before step {r.step + 1}"
        return r, f"{started} while process(es) have started step {max(steps)}"
    at = "start-up" if not steps or max(steps) < 0 else f"step {max(steps)}"
    return None, f"every process is alive at {at}: a collective, the network or the filesystem hangs them all"


def _fault(process: int, attempt: int) -> int | None:
    """The step before which this process is to hang (MAXTEXT_MOE_FAULT), or None."""
    spec = os.environ.get(FAULT_VAR)
    if not spec:
        return None
    kind, *fields = spec.split(":")
    try:
        values = {k: int(v) for k, v in (f.split("=") for f in fields)}
    except ValueError:
        values = {}
    if kind != "hang" or not {"process", "step"} <= set(values) <= {"process", "step", "attempt"}:
        raise UserError(
            f"cannot read {spec!r}.",
            key=FAULT_VAR,
            source="environment",
            fix="write hang:process=K:step=N[:attempt=A], or unset it.",
        )
    if values["process"] != process or values.get("attempt", attempt) != attempt:
        return None
    return values["step"]


class Watchdog:
    """This process's heartbeat writer and hang watchdog (one daemon thread)."""

    def __init__(self, run: Path, process: int, settings: JobSettings, *, out=None) -> None:
        self.run = run
        self.settings = settings
        self.attempt = int(os.environ.get(ATTEMPT_VAR, "0") or 0)
        self.hang_before = _fault(process, self.attempt)
        launched = float(os.environ.get(LAUNCHED_VAR, "0")) or None
        host = socket.gethostname()
        self.record = Record(
            process, host, os.getpid(), self.attempt, None, None, time.time(), launched, launch=launch_id()
        )
        self.started = time.time()
        self.slowest: float | None = None  # the slowest step seen, the first (compilation) left out
        self.first: int | None = None  # the first step this process ran
        self.out = out or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="maxtext-moe-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        # The launcher ends an attempt with SIGTERM to every process (srun --kill-on-bad-exit, a pod's stop):
        # each one's stacks go to the run folder then, before JAX's preemption handler (chained) takes it.
        self._stacks_path.parent.mkdir(parents=True, exist_ok=True)
        self._stacks = self._stacks_path.open("a")  # earlier attempts' stacks stay
        self._kept = self._stacks.tell()
        r = self.record
        self._stacks.write(f"== process {r.process} on {r.host} (pid {r.pid}), attempt {r.attempt}, {time.ctime()}\n")
        self._stacks.flush()
        self._header_end = self._stacks.tell()
        faulthandler.register(signal.SIGTERM, file=self._stacks, all_threads=True, chain=True)
        self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=2 * INTERVAL_S)
        faulthandler.unregister(signal.SIGTERM)
        self._stacks.close()
        if self._stacks_path.stat().st_size == self._header_end:  # no stacks this time: drop the header
            os.truncate(self._stacks_path, self._kept)
        if self._stacks_path.stat().st_size == 0:
            self._stacks_path.unlink()
            with contextlib.suppress(OSError):
                self._stacks_path.parent.rmdir()

    @property
    def _stacks_path(self) -> Path:
        return self.run / STACKS / f"process-{self.record.process}.txt"

    def before_step(self, step: int) -> None:
        """MaxText's loop is about to run `step` (upstream.step_hook)."""
        if step == self.hang_before:  # the record keeps the step before: this process never starts this one
            self.out(f"maxtext-moe: {FAULT_VAR}: process {self.record.process} stops before step {step}, as asked.")
            while True:
                time.sleep(3600)
        now = time.time()
        with self._lock:
            r = self.record
            if r.step is not None and r.step_started is not None and r.step != self.first:
                self.slowest = max(self.slowest or 0.0, now - r.step_started)
            if self.first is None:
                self.first = step
            r.step, r.step_started = step, now
        self._write()

    def timeout(self) -> float | None:
        return self.settings.timeout(self.slowest)

    def _write(self) -> None:
        with self._lock:  # the step hook and the thread both write; a newer record must not be overtaken
            self.record.updated = time.time()
            write_json(record_path(self.run, self.record.process), asdict(self.record))

    def _loop(self) -> None:
        while not self._done.wait(INTERVAL_S):
            self._write()
            timeout = self.timeout()
            since = self.record.step_started or self.started
            if timeout is not None and time.time() - since > timeout:
                self._fire(time.time() - since, timeout)

    def _fire(self, waited: float, timeout: float) -> None:
        """Stacks to the run folder, one line naming the silent process, and out with STALLED."""
        r = self.record
        stacks = self._stacks_path
        self._stacks.write(
            f"process {r.process} on {r.host} (pid {r.pid}), {time.ctime()}: no step for {waited:.0f} s\n"
        )
        self._stacks.flush()
        faulthandler.dump_traceback(self._stacks, all_threads=True)
        who, why = silent(read_records(self.run, r.launch), time.time())
        where = "no step started yet" if r.step is None else f"step {r.step} started {waited:.0f} s ago"
        named = f"process {who.process} on {who.host} (pid {who.pid}) is silent: {why}" if who else why
        how = "auto" if self.settings.watchdog_auto else "set"
        line = (
            f"maxtext-moe: watchdog: process {r.process} on {r.host} has made no progress ({where}; timeout "
            f"{timeout:.0f} s, job.watchdog {how}); {named}. Stacks in {stacks.parent}."
        )
        r.verdict = line
        self._write()
        self.out(line)
        os._exit(STALLED)
