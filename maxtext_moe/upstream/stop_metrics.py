"""Keep the metrics of the step a termination signal stopped the run at.

The gap: MaxText 0.2.5's loop saves a step's checkpoint (`checkpointing.maybe_save_checkpoint`) before it hands
that step's metrics to its logger (`MetricLogger.buffer_and_write_metrics`), and on a SIGTERM (a scheduler's
stop, our Ctrl-C, the divergence guard's stop) the save raises `StopTraining` in between: the checkpoint holds
step N while the metrics file, TensorBoard and the progress line end at N-1. This holds that `StopTraining` back
until the step's training metrics are buffered, then raises it; MaxText's `finally` flushes the buffer as it
does for any stop. The save after the loop (no step given) has nothing after it and raises at once.
"""

from __future__ import annotations

import functools
from typing import Any

_held: list[BaseException] = []  # the StopTraining of the step in flight, raised once its metrics are buffered


def install() -> None:
    """Hold MaxText's SIGTERM stop until the stopped step's metrics are buffered, from now on in this process."""
    from maxtext.common import checkpointing
    from maxtext.common.metric_logger import MetricLogger
    from maxtext.utils import exceptions

    _held.clear()  # a stop held by an earlier attempt in this process (a rollback) is not this one's
    save = getattr(checkpointing.maybe_save_checkpoint, "maxtext_original", checkpointing.maybe_save_checkpoint)
    buffer = getattr(MetricLogger.buffer_and_write_metrics, "maxtext_original", MetricLogger.buffer_and_write_metrics)

    @functools.wraps(save)
    def save_and_hold_stop(checkpoint_manager: Any, state: Any, config: Any, data_iterator: Any, step: Any = None):
        try:
            return save(checkpoint_manager, state, config, data_iterator, step)
        except exceptions.StopTraining as stop:
            if step is None:
                raise
            _held.append(stop)
            return None

    @functools.wraps(buffer)
    def buffer_then_stop(self: Any, metrics: Any, step: Any, step_time_delta: Any = None, is_training: bool = True):
        buffer(self, metrics, step, step_time_delta, is_training)
        if is_training and _held:
            raise _held.pop()

    save_and_hold_stop.maxtext_original = save  # type: ignore[attr-defined]
    buffer_then_stop.maxtext_original = buffer  # type: ignore[attr-defined]
    checkpointing.maybe_save_checkpoint = save_and_hold_stop
    MetricLogger.buffer_and_write_metrics = buffer_then_stop
