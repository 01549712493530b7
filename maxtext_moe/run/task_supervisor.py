"""One task of a multi-process job as two processes: a small parent that records how the trainer ended.

The gap: when one process of a job dies (SIGKILL from the OOM killer, a segfault), `srun --kill-on-bad-exit`
and the Kubernetes pod script stop every other one, and the job's output then holds N processes that all
"ended" with nothing saying which one went first. JAX's coordination service knows, but only after its
heartbeat timeout, and the launcher has killed everyone by then. The parent here, which imports no jax, starts
`maxtext-moe train ...` again as its child, passes on every signal the launcher sends, and writes
`<run>/processes/exit-K.json`: the child's status, and whether it ended by itself or on the
launcher's signal. `maxtext-moe report` reads those records after the job's attempt (`run/job_report.py`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from maxtext_moe.run import watchdog

CHILD_VAR = "MAXTEXT_MOE_SUPERVISED"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)


def exit_path(run: Path, process: int) -> Path:
    return run / watchdog.PROCESSES / f"exit-{process}.json"


def wanted(num_processes: int) -> bool:
    """A process of a multi-process job that is not itself the supervised child."""
    return num_processes > 1 and not os.environ.get(CHILD_VAR)


def describe(status: int) -> str:
    """A child's status as Popen gives it (negative: the signal that killed it) in words."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return "stalled (watchdog)" if status == watchdog.STALLED else f"exited with status {status}"


def run(argv: list[str], run_dir: Path, process: int) -> int:
    """Run `python -m maxtext_moe ARGV` as the child, record how it ended, and end as it did."""
    exit_record = exit_path(run_dir, process)
    exit_record.unlink(missing_ok=True)
    received: list[int] = []
    env = dict(os.environ, **{CHILD_VAR: "1", watchdog.LAUNCHED_VAR: str(time.time())})
    child = subprocess.Popen([sys.executable, "-m", "maxtext_moe", *argv], env=env)

    def forward(signum: int, _frame: object) -> None:
        if signum != signal.SIGCONT:
            received.append(signum)
        child.send_signal(signum)

    for s in FORWARDED:
        signal.signal(s, forward)
    status = child.wait()
    by_launcher = bool(received) and status != 0
    watchdog.write_json(
        exit_record,
        {
            "process": process,
            "host": socket.gethostname(),
            "pid": child.pid,
            "status": status,
            "how": describe(status),
            "by": "launcher" if by_launcher else "itself",
            "signals": [signal.Signals(s).name for s in received],
            "time": time.time(),
            "launch": watchdog.launch_id(),
        },
    )
    if status < 0:  # end as the child did, so that the launcher sees the same signal
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # neither can be caught, nor handed a disposition
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status
