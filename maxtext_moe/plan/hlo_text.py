"""Reading XLA's optimized-module text dump: which file holds the step, and its computations by name.

Why a module: `exchange_overlap` (what XLA scheduled inside each all-to-all) and `remat_gemms` (the GEMM work
XLA recomputes) read the same dump, split the same way; `tools/profile.py` finds the same file.
"""

from __future__ import annotations

import re
from pathlib import Path

from maxtext_moe.errors import UserError

COMPUTATION = re.compile(r"\n(?=%|ENTRY )")
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.\-]+) = ")
CALLS = re.compile(r"calls=(%[\w.\-]+)")
BODY = re.compile(r"body=(%[\w.\-]+)")


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
