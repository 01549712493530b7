"""The recipe's `training:` schedules inside MaxText's step: learning rate, batch ramp, bias-update rate, MTP weight.

The gaps in MaxText 0.2.5, each closed by the smallest touch:

- Learning rate: `maxtext_utils.create_learning_rate_schedule` builds one shape (warm-up, then cosine or WSD to
  zero); DeepSeek-V3's has a constant phase, a cosine to a floor, then two constants. It is rebound to return
  the `training:` schedule, joined from optax's own pieces (`lr_schedule`); the optimizer and the metric logger
  (`learning/current_learning_rate`) both take it from there.
- Batch ramp: MaxText's `enable_rampup_batch_size` slices the loaded batch to a growing size, so each size is
  another compilation, and its manager ignores gradient accumulation. Instead `train.train_step` is wrapped to
  zero `targets_segmentation` of the rows past the step's batch: those tokens leave the loss and its token count
  (MaxText divides by the unmasked tokens), so the gradient is the smaller batch's, in one compiled step.
- Bias-update rate and MTP weight: MaxText reads `routed_bias_update_rate` and `mtp_loss_scaling_factor` as
  constants. The recipe sets each to its schedule's largest value, and the step scales it by the value of the step
  over that: `moe.load_balance_updates_from_counts` (also as imported by `gradient_accumulation`) and
  `train.calculate_mtp_loss` are rebound to multiply by the factor of the step the wrapped `train_step` traces.

The step's own schedule values are added to its metrics as `schedule/batch`, `schedule/bias_update_rate` and
`schedule/mtp_weight`.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxtext_moe.recipe.timeline import Timeline

# The optimizer step of the `train_step` being traced: a traced integer, or None outside it (eval, compile checks).
_STEP: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("training_schedule_step", default=None)


def lr_schedule(line: Timeline) -> optax.Schedule:
    """The learning rate by step: linear warm-up from 0, the peak, a cosine decay to a floor, then constants."""
    start, end = line.step_at(line.lr_constant_until), line.step_at(line.lr_cosine_until)
    pieces: list[optax.Schedule] = []
    boundaries: list[int] = []
    if line.warmup_steps:
        pieces.append(optax.linear_schedule(0.0, line.lr_peak, line.warmup_steps))
        boundaries.append(line.warmup_steps)
    pieces.append(optax.constant_schedule(line.lr_peak))
    boundaries.append(start)
    alpha = line.lr_cosine_to / line.lr_peak
    pieces.append(optax.cosine_decay_schedule(line.lr_peak, max(1, end - start), alpha=alpha))
    boundaries.append(end)
    pieces.append(optax.constant_schedule(line.lr_cosine_to))
    for first, value in line.lr_steps_tail():
        pieces.append(optax.constant_schedule(value))
        boundaries.append(first)
    return optax.join_schedules(pieces, boundaries)


def step_function(points: tuple[tuple[int, float], ...], step: jax.Array) -> jax.Array:
    """A step function given as (first step, value) pairs, at a traced `step`."""
    value = jnp.float32(0.0)
    for first, v in points:
        value = jnp.where(step >= first, jnp.float32(v), value)
    return value


def _factor(points: tuple[tuple[int, float], ...]) -> jax.Array | float:
    """The schedule's value at the traced step over its largest value (the constant MaxText was given)."""
    step, top = _STEP.get(), max(v for _, v in points)
    if step is None or top == 0:
        return 1.0
    return step_function(points, step) / top


def _optimizer_step(state: Any) -> jax.Array:
    """The optimizer's step count in the state `train_step` receives: the index of the step being trained."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        keys = tuple(str(getattr(k, "key", getattr(k, "name", ""))) for k in path)
        if len(keys) >= 2 and keys[0] == "optimizer" and keys[1] == "step":
            return jnp.asarray(leaf, jnp.int32)
    raise KeyError("no optimizer step in the training state")


def mask_rows(data: dict[str, jax.Array], batch: jax.Array) -> dict[str, jax.Array]:
    """`data` with the loss of every row at or past `batch` masked (`targets_segmentation` 0)."""
    seg = data["targets_segmentation"]
    keep = (jnp.arange(seg.shape[0]) < batch)[:, None]
    return dict(data, targets_segmentation=jnp.where(keep, seg, 0))


def install(line: Timeline) -> None:
    """Run the `training:` schedules in every training step MaxText builds from now on in this process."""
    from maxtext.layers import moe
    from maxtext.trainers.pre_train import train
    from maxtext.utils import gradient_accumulation, maxtext_utils

    schedule = lr_schedule(line)
    maxtext_utils.create_learning_rate_schedule = lambda config: schedule
    levels = tuple((first, float(batch)) for first, batch in line.levels)
    bias, mtp = line.bias_steps(), line.mtp_steps()

    updates: Callable[..., Any] = getattr(moe.load_balance_updates_from_counts, "schedule_inner", None) or (
        moe.load_balance_updates_from_counts
    )

    def scheduled_updates(expert_counts: jax.Array, num_experts: int, rate: float) -> jax.Array:
        return updates(expert_counts, num_experts, rate * _factor(bias))

    mtp_loss: Callable[..., Any] = getattr(train.calculate_mtp_loss, "schedule_inner", None) or train.calculate_mtp_loss

    def scheduled_mtp_loss(intermediate_outputs: Any, config: Any) -> jax.Array:
        return mtp_loss(intermediate_outputs, config) * _factor(mtp)

    step: Callable[..., Any] = getattr(train.train_step, "schedule_inner", None) or train.train_step

    @functools.wraps(step)
    def train_step(
        model: Any,
        config: Any,
        state_mesh_shardings: Any,
        params_shardings: Any,
        state: Any,
        data: dict[str, jax.Array],
        dropout_rng: Any = None,
    ) -> tuple[Any, dict]:
        index = _optimizer_step(state)
        batch = step_function(levels, index)
        token = _STEP.set(index)
        try:
            new_state, metrics = step(
                model, config, state_mesh_shardings, params_shardings, state, mask_rows(data, batch), dropout_rng
            )
        finally:
            _STEP.reset(token)
        metrics["scalar"].update(
            {
                "schedule/batch": batch,
                "schedule/bias_update_rate": step_function(bias, index),
                "schedule/mtp_weight": step_function(mtp, index),
            }
        )
        return new_state, metrics

    scheduled_updates.schedule_inner = updates  # type: ignore[attr-defined]
    scheduled_mtp_loss.schedule_inner = mtp_loss  # type: ignore[attr-defined]
    train_step.schedule_inner = step  # type: ignore[attr-defined]
    moe.load_balance_updates_from_counts = scheduled_updates
    gradient_accumulation.load_balance_updates_from_counts = scheduled_updates
    train.calculate_mtp_loss = scheduled_mtp_loss
    train.train_step = train_step
