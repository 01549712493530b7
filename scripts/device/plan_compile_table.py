"""The table `plan_compile_h200.sh` prints last: per recipe, XLA's per-device memory beside the plan's.

Usage: python3 scripts/device/plan_compile_table.py DIR  (DIR holds NAME.json from `plan --compile --json`,
and NAME.log for the recipes that failed)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def row(path: Path) -> str:
    name = path.stem
    result = path.with_suffix(".json")
    if not result.exists() or not result.stat().st_size:
        lines = [ln for ln in path.with_suffix(".log").read_text(errors="replace").splitlines() if ln.strip()]
        return f"{name:<42} failed: {(lines[-1] if lines else 'no output')[:150]}"
    d = json.loads(result.read_text())
    c, p = d["compiled"], d["planned"]
    return (
        f"{name:<42} {d['route']:<4} {c['devices']:>5} {c['device_kind'][:14]:<14} "
        f"{c['memory']['argument_size'] / GIB:>8.1f} {c['memory'].get('temp_size', 0) / GIB:>8.1f} "
        f"{c['device_total_bytes'] / GIB:>8.1f} {p['memory_per_gpu_bytes'] / GIB:>8.1f} "
        f"{d['compiled_over_planned']:>6.2f} {d['state_compiled_over_planned']:>6.3f} {c['compile_s']:>6.0f}"
    )


def main(folder: str) -> int:
    names = sorted({p.stem for p in Path(folder).glob("*.json")} | {p.stem for p in Path(folder).glob("*.log")})
    names = [n for n in names if n != "detached"]  # PLAN_DETACH's own log, not a recipe's
    print(
        f"{'recipe':<42} {'via':<4} {'devs':>5} {'device':<14} {'arg GiB':>8} {'temp GiB':>8} "
        f"{'XLA GiB':>8} {'plan GiB':>8} {'ratio':>6} {'state':>6} {'comp s':>6}"
    )
    for name in names:
        print(row(Path(folder) / name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
