"""After a failed restore, Orbax's leftover reads printed "Event loop is closed" tracebacks around the
one-line error (CI, 2026-12-01; 8 of 10 tries by hand). `late_errors` sends such output to the run log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
from pathlib import Path
from maxtext_moe.run import late_errors

late_errors.send_to(Path(sys.argv[1]))

class Leftover:
    def __del__(self):
        raise ValueError("a read finished after its restore failed")

Leftover()  # unraisable: what Python prints as "Exception ignored in: ..."
raise RuntimeError("Event loop is closed")  # uncaught: what a C callback's PyErr_Print shows
"""


def test_late_tracebacks_go_to_the_log_not_the_terminal(tmp_path: Path) -> None:
    log = tmp_path / "maxtext.log"
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr == "" and r.stdout == ""
    text = log.read_text()
    assert "Exception ignored in: <function Leftover.__del__" in text
    assert "ValueError: a read finished after its restore failed" in text
    assert "RuntimeError: Event loop is closed" in text


TRACEBACK_AFTER_A_RUN = """
import sys
from pathlib import Path
from maxtext_moe import cli
from maxtext_moe.commands import recipes
from maxtext_moe.run import late_errors

late_errors.send_to(Path(sys.argv[1]))  # as a failed train command leaves the process


def boom(ref, overrides):
    raise RuntimeError("boom")


recipes.resolve = boom  # what `show` resolves its recipe with
sys.exit(cli.main(["--traceback", "show", "deepseek3-tiny-cpu"]))
"""


def test_traceback_flag_still_prints_to_the_terminal(tmp_path: Path) -> None:
    """--traceback re-raised unexpected errors, which the hook would then have sent to the log instead."""
    log = tmp_path / "maxtext.log"
    r = subprocess.run(
        [sys.executable, "-c", TRACEBACK_AFTER_A_RUN, str(log)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and "RuntimeError: boom" in r.stderr
    assert not log.exists() or "boom" not in log.read_text()
