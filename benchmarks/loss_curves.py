"""Two bench runs' loss curves side by side, and whether the second stays within a tolerance of the first.

Made for FP8 against BF16 on the same recipe, data and seed: `maxtext-moe bench` records every timed
step's loss (`losses` in its JSON); this prints a Markdown table of both curves, smoothed over a few steps
(single steps differ by batch noise that has nothing to do with precision), and judges the end of the
compared steps: the relative gap of the mean loss over the last `--window` of them must be within
`--tolerance`. Exits 1 when it is not, so a device script can stop on it.

A run stopped before its end (a device call's time limit) left no JSON, only its log: the log's progress
lines (`step N/TOTAL | loss X`, four decimals) stand in for it, the steps after `--warmup` as its timed
steps. Runs of different lengths are compared over the steps both reached, and only if both were set up
for the same total: the learning-rate schedule spans the run, so otherwise step k means different things.

    python benchmarks/loss_curves.py docs/results/BF16.json docs/results/FP8.json --tolerance 0.01
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Run:
    name: str
    warmup: int
    total: int  # warm-up + timed steps the run was set up for
    losses: list[float]  # of the timed steps it finished


_PROGRESS = re.compile(r"^step\s+(\d+)/(\d+) \| loss (\S+)")


def load(path: Path, warmup: int) -> Run:
    """A bench JSON, or (any other file) the bench's log with `warmup` untimed steps first."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if not data.get("losses"):
            sys.exit(f"{path}: no per-step losses (bench JSON from before they were recorded?)")
        return Run(path.name, data["warmup_steps"], data["warmup_steps"] + data["timed_steps"], data["losses"])
    steps = {}
    for line in path.read_text(errors="replace").splitlines():
        if m := _PROGRESS.match(line):
            steps[int(m[1])] = (int(m[2]), float(m[3]))
    timed = [steps[s][1] for s in range(warmup + 1, max(steps, default=0) + 1) if s in steps]
    if not timed:
        sys.exit(f"{path}: no progress lines past {warmup} warm-up steps")
    return Run(path.name, warmup, steps[max(steps)][0], timed)


def smoothed(losses: list[float], width: int) -> list[float]:
    """Trailing mean over `width` steps (fewer at the start)."""
    return [statistics.fmean(losses[max(0, i + 1 - width) : i + 1]) for i in range(len(losses))]


def compare(base: list[float], other: list[float], window: int) -> dict[str, float]:
    steps = min(len(base), len(other))
    window = min(window, steps)
    tail_base, tail_other = (
        statistics.fmean(base[steps - window : steps]),
        statistics.fmean(other[steps - window : steps]),
    )
    return {
        "steps": steps,
        "window": window,
        "base_tail_mean": tail_base,
        "other_tail_mean": tail_other,
        "relative_gap": (tail_other - tail_base) / tail_base,
    }


def table(base: Run, other: Run, steps: int, every: int, width: int) -> str:
    a, b = smoothed(base.losses[:steps], width), smoothed(other.losses[:steps], width)
    rows = ["| step | base | other | other / base |", "| ---: | ---: | ---: | ---: |"]
    picks = sorted({*range(0, steps, every), steps - 1})
    rows += [f"| {base.warmup + 1 + i} | {a[i]:.4f} | {b[i]:.4f} | {b[i] / a[i]:.4f} |" for i in picks]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path, help="bench JSON (or log) of the reference run (BF16)")
    parser.add_argument("other", type=Path, help="bench JSON (or log) of the run held to it (FP8)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of a log (bench's default)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative gap of the tail means")
    parser.add_argument("--window", type=int, default=50, help="steps at the end whose mean loss is compared")
    parser.add_argument("--every", type=int, default=20, help="a table row every this many steps")
    parser.add_argument("--smooth", type=int, default=10, help="steps in the table's trailing mean")
    parser.add_argument("--json", type=Path, help="also write the verdict and both curves here")
    args = parser.parse_args(argv)
    base, other = load(args.base, args.warmup), load(args.other, args.warmup)
    if (base.warmup, base.total) != (other.warmup, other.total):
        sys.exit(
            f"{base.name} was set up for {base.warmup} + {base.total - base.warmup} steps and {other.name} for "
            f"{other.warmup} + {other.total - other.warmup}: compare runs with the same schedule"
        )
    verdict = compare(base.losses, other.losses, args.window)
    ok = abs(verdict["relative_gap"]) <= args.tolerance
    print(f"base: {base.name}, other: {other.name} (loss, trailing mean of {args.smooth} steps)\n")
    print(table(base, other, verdict["steps"], args.every, args.smooth))
    print(
        f"\nmean loss over the last {verdict['window']} of the {verdict['steps']} timed steps both ran: "
        f"{verdict['base_tail_mean']:.4f} vs {verdict['other_tail_mean']:.4f}, "
        f"gap {verdict['relative_gap']:+.2%} (tolerance {args.tolerance:.2%}): {'within' if ok else 'OUTSIDE'}"
    )
    if args.json:
        record = dict(verdict, tolerance=args.tolerance, within=ok, base=base.losses, other=other.losses)
        args.json.write_text(json.dumps(record, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
