"""`maxtext-moe report`: one line saying what ended a job's last attempt, for the job's output.

The job script (`maxtext-moe launch`) runs this after every attempt that did not finish, before it restarts
or gives up, so the last lines of a job's output name the lost or hung process, its host, and the checkpoint
the next attempt resumes from. It exits with `USER_ERROR` when a process's own error in the recipe, the data
or the run folder came first (as it does when it cannot read the recipe itself): the script then stops instead
of spending its restarts on the same error. It reads what the processes left in the run folder: the supervisors' exit
records (`run/task_supervisor.py`) and the heartbeats and verdicts of the watchdog (`run/watchdog.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.run import run_dir, watchdog

STOPPED = (130, 143)  # a checkpoint at the next step, then out: Ctrl-C, SIGTERM
USER_ERROR = 2  # maxtext-moe's status for an error in the recipe, the data or the run folder; `report`'s too


@dataclass(frozen=True)
class Cause:
    text: str
    repeats: bool = False  # a process's own USER_ERROR came first: every restart would end the same way


def cause(run: Path, launch: str) -> Cause:
    """What ended `launch`: a hung process (a watchdog's verdict), a process that ended by itself, a process that
    left no record (its host went away), a stop on a signal, or a finished run."""
    records = {r.process: r for r in watchdog.read_records(run, launch)}
    exits = {int(e["process"]): e for e in watchdog.read_json(run, "exit-*.json", launch)}
    # The first thing that went wrong: a process that ended by itself (an error, a signal of its own), or a
    # watchdog's verdict on a silent process; what the launcher then did to the others follows from it.
    events = [
        (r.updated, Cause("hung: " + r.verdict.removeprefix("maxtext-moe: ").rstrip(".")))
        for r in records.values()
        if r.verdict
    ]
    for e in exits.values():
        if e["by"] == "itself" and e["status"] not in (0, watchdog.STALLED, *STOPPED):
            r = records.get(e["process"])
            at = "" if r is None or r.step is None else f" in step {r.step}"
            text = f"lost: process {e['process']} on {e['host']} (pid {e['pid']}) {e['how']}{at}"
            events.append((e["time"], Cause(text, repeats=e["status"] == USER_ERROR)))
    if events:
        return min(events, key=lambda event: event[0])[1]
    missing = sorted(set(records) - set(exits))
    if missing:
        r = records[missing[0]]
        return Cause(
            f"lost: process {r.process} on {r.host} (pid {r.pid}) left no exit record: its host or its "
            "supervisor went away"
        )
    statuses = {e["status"] for e in exits.values()}
    if statuses and statuses <= set(STOPPED):
        return Cause("stopped: every process saved a checkpoint and stopped on a signal")
    if statuses == {0}:
        return Cause("finished")
    return Cause("ended: " + ", ".join(f"process {p} {e['how']}" for p, e in sorted(exits.items())))


def line(run: Path) -> tuple[str, bool]:
    """`cause` of this launch (the job script's, whose variables name it), with the checkpoint a re-run resumes
    from; and whether a restart would repeat it."""
    found = cause(run, watchdog.launch_id())
    latest = run_dir.scan(run / "checkpoints").latest
    where = "no complete checkpoint yet" if latest is None else f"the last complete checkpoint is step {latest}"
    text = f"maxtext-moe: {found.text}; {where} in {run / 'checkpoints'}."
    if found.repeats:
        text += " A restart would end the same way: fix what the process's error says, then submit the job again."
    return text, found.repeats
