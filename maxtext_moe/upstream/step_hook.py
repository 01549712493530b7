"""Call a function before each training step, in every process.

The gap: MaxText 0.2.5's loop (`train.train_loop`) has no per-step callback, and only process 0 writes the
metrics file that `run/progress.py` follows, so nothing tells a process other than 0 that its own loop moves.
This wraps `train.training_loop_iteration`, the one call each process makes per step, which `train_loop` looks
up in its module at every step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def install(before_step: Callable[[int], None]) -> None:
    """Call `before_step(step)` before each step of MaxText's loop in this process, from now on."""
    from maxtext.trainers.pre_train import train

    original = getattr(train.training_loop_iteration, "maxtext_original", train.training_loop_iteration)

    @functools.wraps(original)
    def iteration(jax_device_state: Any, python_vars: dict, immutable_data: Any) -> Any:
        before_step(int(python_vars["step"]))
        return original(jax_device_state, python_vars, immutable_data)

    iteration.maxtext_original = original  # type: ignore[attr-defined]
    train.training_loop_iteration = iteration
