"""No module of the package over 400 lines: a module that grows past that does more than one job."""

from __future__ import annotations

from pathlib import Path

import maxtext_moe

LIMIT = 400


def test_no_module_exceeds_the_line_limit() -> None:
    root = Path(maxtext_moe.__file__).parent
    sizes = {
        str(p.relative_to(root.parent)): len(p.read_text(encoding="utf-8").splitlines()) for p in root.rglob("*.py")
    }
    over = {path: n for path, n in sizes.items() if n > LIMIT}
    assert not over, f"split these by job (at most {LIMIT} lines each): {over}"
