"""Tracebacks that Orbax's and TensorStore's background work prints after a failed run go to the run's log.

The gap: when one array of a checkpoint cannot be read, Orbax raises the first error and closes its event
loop while TensorStore still completes the restore's other reads; their callbacks then reach the closed
loop, and Python prints each failure ("RuntimeError: Event loop is closed" through `sys.excepthook`, which
a C callback's `PyErr_Print` calls, and "Exception ignored in: <coroutine ...>" through
`sys.unraisablehook`), before and after the one-line error: 5 to 105 lines on 8 of 10 tries with a
damaged data file. Neither MaxText nor Orbax routes them anywhere else, so these hooks append them to the
run's log for the rest of the process (it ends with the run).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from types import TracebackType


def send_to(log: Path) -> None:
    """Write uncaught and unraisable errors to `log` from now on in this process, not to the terminal."""

    def write(text: str) -> None:
        with log.open("a", encoding="utf-8") as f:
            f.write(text)

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        write("".join(traceback.format_exception(kind, value, tb)))

    def unraisablehook(u: sys.UnraisableHookArgs) -> None:
        where = f"Exception ignored in: {u.object!r}\n" if u.object is not None else ""
        write(where + "".join(traceback.format_exception(u.exc_type, u.exc_value, u.exc_traceback)))

    sys.excepthook = excepthook
    sys.unraisablehook = unraisablehook
