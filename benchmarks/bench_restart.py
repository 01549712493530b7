"""Time a restart to its first step, with and without JAX's persistent compilation cache, on this machine.

Why a benchmark of its own: every restart of a job (a lost or hung process, a requeue) pays the start-up again,
and the compile is the part a cache can save. One process of the tiny recipe trains from scratch, filling a fresh
cache; then the run is resumed twice, once reading that cache and once with the cache off. The three runs
compile the same program (`learning_rate_schedule_steps` is fixed, only `steps` grows). The time is from the
command's start to process 0's first progress line, the moment the first step of the run has finished.

    .venv/bin/python benchmarks/bench_restart.py --out restart.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHRINK = ["per_device_batch_size=2", "max_target_length=128", "checkpoint_period=2", "learning_rate_schedule_steps=8"]


def first_step_s(out: Path, cache: str, steps: int) -> float:
    """Seconds from `maxtext-moe train` starting to its first progress line; the run then goes on to `steps`."""
    cmd = [sys.executable, "-m", "maxtext_moe", "train", "deepseek3-tiny-cpu", *SHRINK, f"steps={steps}",
           f"base_output_directory={out}", f"jax_cache_dir={cache}"]  # fmt: skip
    start = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    seen = None
    for line in proc.stdout:
        if seen is None and line.startswith("step "):
            seen = time.time() - start
    if proc.wait() != 0 or seen is None:
        raise SystemExit(f"{' '.join(cmd)} failed (status {proc.returncode})")
    return seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the JSON result here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        runs, cache = Path(tmp) / "runs", str(Path(tmp) / "jax_cache")
        result = {
            "fresh_start_filling_the_cache_s": first_step_s(runs, cache, 2),
            "restart_with_cache_s": first_step_s(runs, cache, 4),
            "restart_without_cache_s": first_step_s(runs, "", 6),
        }
    print(json.dumps(result, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
