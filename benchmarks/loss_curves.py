"""Two bench runs' loss curves side by side, and whether the second stays within a tolerance of the first.

Made for FP8 against BF16 on the same recipe, data and seed: `maxtext-moe bench` records every timed
step's loss (`losses` in its JSON); this prints a Markdown table of both curves, smoothed over a few steps
(single steps differ by batch noise that has nothing to do with precision), and judges the end of the run:
the relative gap of the mean loss over the last `--window` steps must be within `--tolerance`. Exits 1
when it is not, so a device script can stop on it.

    python benchmarks/loss_curves.py docs/results/BF16.json docs/results/FP8.json --tolerance 0.01
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not data.get("losses"):
        sys.exit(f"{path}: no per-step losses (bench JSON from before they were recorded?)")
    return data


def smoothed(losses: list[float], width: int) -> list[float]:
    """Trailing mean over `width` steps (fewer at the start)."""
    return [statistics.fmean(losses[max(0, i + 1 - width) : i + 1]) for i in range(len(losses))]


def compare(base: list[float], other: list[float], window: int) -> dict[str, float]:
    if len(base) != len(other):
        raise SystemExit(f"the runs have {len(base)} and {len(other)} timed steps: compare equal runs")
    window = min(window, len(base))
    tail_base, tail_other = statistics.fmean(base[-window:]), statistics.fmean(other[-window:])
    return {
        "steps": len(base),
        "window": window,
        "base_tail_mean": tail_base,
        "other_tail_mean": tail_other,
        "relative_gap": (tail_other - tail_base) / tail_base,
    }


def table(base: dict[str, Any], other: dict[str, Any], every: int, width: int) -> str:
    a, b = smoothed(base["losses"], width), smoothed(other["losses"], width)
    first = base["warmup_steps"]  # the timed steps' numbers in the run
    rows = ["| step | base | other | other / base |", "| ---: | ---: | ---: | ---: |"]
    picks = sorted({*range(0, len(a), every), len(a) - 1})
    rows += [f"| {first + i} | {a[i]:.4f} | {b[i]:.4f} | {b[i] / a[i]:.4f} |" for i in picks]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="bench JSON of the reference run (BF16)")
    parser.add_argument("other", type=Path, help="bench JSON of the run held to it (FP8)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative gap of the tail means")
    parser.add_argument("--window", type=int, default=50, help="steps at the end whose mean loss is compared")
    parser.add_argument("--every", type=int, default=20, help="a table row every this many steps")
    parser.add_argument("--smooth", type=int, default=10, help="steps in the table's trailing mean")
    parser.add_argument("--json", type=Path, help="also write the verdict and both curves here")
    args = parser.parse_args(argv)
    base, other = load(args.base), load(args.other)
    verdict = compare(base["losses"], other["losses"], args.window)
    ok = abs(verdict["relative_gap"]) <= args.tolerance
    print(f"base: {args.base.name}, other: {args.other.name} (loss, trailing mean of {args.smooth} steps)\n")
    print(table(base, other, args.every, args.smooth))
    print(
        f"\nmean loss over the last {verdict['window']} of {verdict['steps']} steps: "
        f"{verdict['base_tail_mean']:.4f} vs {verdict['other_tail_mean']:.4f}, "
        f"gap {verdict['relative_gap']:+.2%} (tolerance {args.tolerance:.2%}): {'within' if ok else 'OUTSIDE'}"
    )
    if args.json:
        record = dict(verdict, tolerance=args.tolerance, within=ok, base=base["losses"], other=other["losses"])
        args.json.write_text(json.dumps(record, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
