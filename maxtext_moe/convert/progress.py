"""One progress line for a long conversion: bytes and tensors done, rate, time left."""

from __future__ import annotations

import time
from collections.abc import Callable


class Progress:
    """Counts written bytes and tensors against their totals; prints at most every `every_s` seconds."""

    def __init__(self, total_bytes: int, total_tensors: int, out: Callable[[str], None], every_s: float = 5.0):
        self.total_bytes, self.total_tensors, self.out, self.every_s = total_bytes, total_tensors, out, every_s
        self.bytes = self.tensors = 0
        self.start = self.shown = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.bytes += nbytes
        self.tensors += 1
        now = time.monotonic()
        if now - self.shown >= self.every_s or self.tensors == self.total_tensors:
            self.shown = now
            self.out(self.line(now))

    def line(self, now: float) -> str:
        rate = self.bytes / max(now - self.start, 1e-9)
        left = (self.total_bytes - self.bytes) / rate if rate else 0.0
        return (
            f"convert: {self.bytes / 2**30:,.2f} of {self.total_bytes / 2**30:,.2f} GiB, "
            f"{self.tensors:,}/{self.total_tensors:,} tensors, {rate / 2**20:,.1f} MiB/s, ETA {left:,.0f}s"
        )
