"""Ctrl-C saves a checkpoint at the next step and stops, as SIGTERM does; a second Ctrl-C aborts.

JAX's preemption notifier (started with `jax.distributed`) watches SIGTERM only, and MaxText's
`enable_autocheckpoint` turns it into a checkpoint at the next step and a clean stop. A
KeyboardInterrupt raised inside MaxText's loop instead unwinds through JAX's runtime and the
process dies with SIGABRT, losing every step since the last periodic checkpoint. While training
runs, the first SIGINT is therefore forwarded to this process as SIGTERM; the second one exits at
once for a user who will not wait for the save.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Interrupts:
    count: int = 0


@contextmanager
def graceful() -> Iterator[Interrupts]:
    """Within the body, SIGINT asks for a checkpoint and stop; how many came is in the yielded record."""
    seen = Interrupts()

    def on_sigint(signum, frame) -> None:
        seen.count += 1
        if seen.count == 1:
            print(
                "maxtext-moe: Ctrl-C: saving a checkpoint at the next step, then stopping "
                "(press Ctrl-C again to abort at once and lose the steps since the last checkpoint).",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGTERM)
            return
        print("maxtext-moe: aborted by a second Ctrl-C; the latest complete checkpoint is kept.", file=sys.stderr)
        sys.stderr.flush()
        os._exit(130)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)
