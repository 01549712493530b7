"""Reading XLA's optimized-module text dump: which file holds the step, and its computations by name.

Why a module: `exchange_overlap` (what XLA scheduled inside each all-to-all), `remat_gemms` (the GEMM work
XLA recomputes) and `memory_traffic` (the bytes its memory-bound kernels move) read the same dump, split the same
way; `tools/profile.py` finds the same file, and `peak` shares the command line of a dump reader.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError

COMPUTATION = re.compile(r"\n(?=%|ENTRY )")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = ")
CALLS = re.compile(r"calls=(%[\w.\-]+)")
BODY = re.compile(r"body=(%[\w.\-]+)")
TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def loop_body(line: str) -> tuple[str, int] | None:
    """The body a `while` instruction runs and how many times (1 where XLA does not know); None for other lines."""
    body = BODY.search(line)
    if body is None:
        return None
    trip = TRIP.search(line)
    return body.group(1), int(trip.group(1)) if trip else 1


def optimized_hlo(dump_dir: Path, module: str = "jit_train_step") -> Path | None:
    """The largest optimized-HLO text XLA dumped in `dump_dir` for a module named `module`, if any."""
    found = list(dump_dir.glob(f"*{module}*after_optimizations.txt")) if dump_dir.is_dir() else []
    return max(found, key=lambda p: p.stat().st_size) if found else None


def read_optimized(dump_dir: Path, module: str = "jit_train_step") -> str:
    """The text of `optimized_hlo`, or a UserError naming the flags that write it."""
    hlo = optimized_hlo(dump_dir, module)
    if hlo is None:
        raise UserError(
            f"no optimized HLO of {module!r} in {dump_dir}.",
            fix="compile with xla_flags.xla_dump_to=DIR xla_flags.xla_dump_hlo_as_text=true.",
        )
    return hlo.read_text()


def computations(hlo: str) -> tuple[str, dict[str, str]]:
    """The entry computation's text, and every computation's text by its name (`%name`, as `calls=` gives it),
    in the module's order."""
    parts = COMPUTATION.split(hlo)
    entry = next((c for c in parts if c.startswith("ENTRY ")), None)
    if entry is None:
        raise UserError("the HLO text has no ENTRY computation.", fix="dump the optimized module as text.")
    return entry, {c.split(" ", 1)[0]: c for c in parts}


def reader_main(
    prog: str, doc: str, read: Callable[[Path, str], Any], argv: Sequence[str] | None, listed: str, top: int
) -> int:
    """The command line of a dump reader (`python -m maxtext_moe.plan.peak DIR`, ...): `read(DIR, module)`
    rendered with its `top` largest `listed`; a UserError is one line and exit status 2."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("dump_dir", type=Path, help="the folder given as xla_flags.xla_dump_to")
    p.add_argument("--module", default="jit_train_step", help="the dumped module's name (default: jit_train_step)")
    p.add_argument("--top", type=int, default=top, help=f"{listed} to list (default: {top})")
    a = p.parse_args(argv)
    try:
        print(read(a.dump_dir, a.module).render(a.top))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
