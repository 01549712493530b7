"""One readable progress line per step: step, loss, the worst MoE layer's load imbalance, tokens/s, the time
left, and a skipped update.

MaxText logs a long line per step among hundreds of INFO lines and never says how long the run
has left. It can also append each step's scalars to a JSON-lines file (`metrics_file`); this
module follows that file from a background thread and prints a short line with an ETA, so the
terminal stays readable while MaxText's full log goes to a file.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path


def read_metrics(path: Path) -> dict[int, dict]:
    """Step -> MaxText's scalars from a metrics file; a resumed run appends, later lines win."""
    out: dict[int, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        m = json.loads(line)
        out[int(m["step"])] = m
    return out


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def balance_note(m: dict) -> str:
    """` | imb 1.80x L3`: the MoE layer whose busiest expert is furthest above the mean load (`moe/tokens_max`
    over `moe/tokens_mean`, see `moe.balance`: 1.00x is perfect balance), and ` | dropped N` when layers
    dropped (token, expert) copies; empty for a step without those scalars. No jax here (see train.py)."""
    worst: tuple[float, str] | None = None
    for key, busiest in m.items():
        if key.startswith("moe/tokens_max/"):
            layer = key.removeprefix("moe/tokens_max/")
            mean = m.get(f"moe/tokens_mean/{layer}", 0.0)
            ratio = busiest / mean if mean > 0 else float("inf")
            if worst is None or ratio > worst[0]:
                worst = (ratio, layer)
    if worst is None:
        return ""
    kind, _, number = worst[1].partition("_")
    short = {"layer": "L", "mtp": "MTP"}.get(kind, "") + str(int(number)) if number.isdigit() else worst[1]
    note = f" | imb {worst[0]:.2f}x {short}"
    dropped = sum(v for k, v in m.items() if k.startswith("moe/dropped/"))
    return note + (f" | dropped {dropped:,.0f}" if dropped else "")


@contextmanager
def prints_to_log(log_file: Path, out: Callable[[str], None]) -> Iterator[Callable[[str], None]]:
    """Send `print` output (MaxText's "Per train step: Total TFLOPs" lines) to `log_file`.

    Yields `out` still reaching the terminal: `print` finds sys.stdout when called, so an `out` that is
    `print` is bound to the terminal's stream first.
    """
    terminal = sys.stdout
    to_terminal = (lambda line: print(line, file=terminal, flush=True)) if out is print else out
    with open(log_file, "a", encoding="utf-8") as f, redirect_stdout(f):
        yield to_terminal


class Progress:
    """Follows `metrics_file` from byte `offset` and reports each new step until stopped."""

    def __init__(
        self,
        metrics_file: Path,
        total_steps: int,
        out: Callable[[str], None] = print,
        poll_s: float = 0.2,
        watch: Callable[[dict], None] | None = None,
    ):
        self.path = metrics_file
        self.total = total_steps
        self.out = out
        self.watch = watch  # also sees each step's scalars (the divergence guard)
        self.poll_s = poll_s
        self.offset = metrics_file.stat().st_size if metrics_file.exists() else 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="maxtext-moe-progress", daemon=True)
        self._times: list[tuple[int, float]] = []
        self.last: dict | None = None

    def __enter__(self) -> Progress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._drain()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._drain()

    def _drain(self) -> None:
        if not self.path.exists():
            return
        if self.path.stat().st_size < self.offset:  # MaxText truncates the file when it starts at step 0
            self.offset = 0
        with open(self.path, encoding="utf-8") as f:
            f.seek(self.offset)
            while True:
                line = f.readline()
                if not line.endswith("\n"):
                    break
                self.offset += len(line.encode("utf-8"))
                try:
                    m = json.loads(line)
                    self.report(m)
                    if self.watch is not None:
                        self.watch(m)
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue

    def report(self, m: dict) -> None:
        step = int(m["step"])
        now = time.monotonic()
        self._times.append((step, now))
        self._times = self._times[-20:]
        eta = ""
        if len(self._times) >= 3:  # the first steps include compilation
            (s0, t0), (s1, t1) = self._times[1], self._times[-1]
            if s1 > s0:
                eta = f" | ETA {_duration((t1 - t0) / (s1 - s0) * (self.total - 1 - step))}"
        self.last = m
        seconds = m.get("perf/step_time_seconds", 0.0)
        # The first step this process runs includes compilation: its throughput would mislead.
        rate = (
            f"{m.get('perf/per_device_tokens_per_sec', 0.0):,.0f} tokens/s/device | {seconds:.2f} s/step"
            if len(self._times) > 1
            else "first step, includes compilation"
        )
        skipped = ""
        if m.get("optim/step_skipped") == 1:  # MaxText's spike wrapper zeroed the update
            finite = all(math.isfinite(m.get(k, 0.0)) for k in ("learning/loss", "learning/grad_norm"))
            skipped = f" | update skipped ({'spike' if finite else 'non-finite'})"
        loss = f"loss {m['learning/loss']:.4f}{balance_note(m)}"
        self.out(f"step {step + 1:>5}/{self.total} | {loss} | {rate}{eta}{skipped}")
