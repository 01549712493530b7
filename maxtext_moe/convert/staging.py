"""Where a conversion writes: `OUT.partial`, renamed to `OUT` only when complete, so that nothing half-written is
ever loaded, and an `OUT` that exists (a finished conversion) is never overwritten."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from maxtext_moe.errors import UserError


def refuse_existing(out: Path) -> None:
    """Stop before any work when `out` exists."""
    if out.exists():
        raise UserError(f"{out} exists.", fix="remove it or choose another OUT; a finished conversion is kept.")


def fresh_partial(out: Path, log: Callable[[str], None]) -> Path:
    """`OUT.partial`, emptied of what an interrupted conversion left there (a restart, not a resume)."""
    partial = out.with_name(out.name + ".partial")
    if partial.exists():
        log(f"convert: removing {partial}, left by an interrupted conversion; starting again")
        shutil.rmtree(partial)
    return partial
