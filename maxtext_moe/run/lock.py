"""One training process per run folder.

Two `train` commands on one run folder both resume from the same checkpoint, interleave one
metrics file and then fail deep in Orbax when both write the same step. A lock file in the run
folder, created atomically and naming the owner's host and PID, refuses the second run at once. A
lock whose owner is gone (same host, no such process) is taken over with a message; a lock held
from another host is never guessed about, the user removes it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from maxtext_moe.errors import UserError

LOCK = "maxtext-moe-run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _create(path: Path, me: dict) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(me, f)
    return True


def acquire(run_dir: Path, log: Callable[[str], None] = print) -> Path:
    """Take the run folder's lock or raise a UserError naming the run that holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK
    host = socket.gethostname()
    me = {"pid": os.getpid(), "host": host, "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    for _attempt in range(3):  # a stale lock removed by two runs at once: one of them creates it
        if _create(path, me):
            return path
        owner = _read(path)
        pid, owner_host = owner.get("pid"), owner.get("host")
        if owner_host == host and isinstance(pid, int) and pid != os.getpid() and _alive(pid):
            raise UserError(
                f"{run_dir} is in use by another training run (PID {pid} on {host}, since {owner.get('since')}).",
                fix=f"wait for it or stop it, or choose another run_name; the lock is {path}.",
            )
        if owner_host not in (None, host):
            raise UserError(
                f"{run_dir} is in use by a training run on host {owner_host} (PID {pid}, since {owner.get('since')}).",
                fix=f"if that run is over, delete {path}; otherwise wait for it or choose another run_name.",
            )
        log(f"run lock: taking over {path} left by PID {pid} on {host}, which is no longer running")
        path.unlink(missing_ok=True)
    raise UserError(f"could not take the run lock {path}: other runs keep taking it.", fix="run one at a time.")


def release(path: Path) -> None:
    """Remove the lock only while it is still ours (a takeover may have replaced it)."""
    if _read(path).get("pid") == os.getpid():
        path.unlink(missing_ok=True)


@contextmanager
def held(run_dir: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold the run folder's lock for the body."""
    path = acquire(run_dir, log)
    try:
        yield
    finally:
        release(path)
