"""Skip a step whose loss or gradient norm is not finite, as MaxText skips a spike, without poisoning its window.

The gap: MaxText 0.2.5's `optimizers.skip_step_on_spikes` zeroes the update of a step whose loss or gradient
norm is above mean + k std of its window, and a NaN fails that comparison too, so the step is skipped; but it
then writes the NaN into the window, every later mean is NaN, and every later step is skipped until the NaN
leaves the window (`window` steps). MaxText's other answer, `abort_on_nan_loss`, ends the run. This wraps the
transform MaxText builds: a step whose loss or gradient norm is not finite gets a zero update and leaves the
wrapper's state (optimizer moments, window, count) as it was, except `is_skipped`, which MaxText reports as
`optim/step_skipped`. Finite steps go through MaxText's transform unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax


def skipping_non_finite(spikes: optax.GradientTransformationExtraArgs) -> optax.GradientTransformationExtraArgs:
    """`spikes` (MaxText's spike wrapper) that also skips a step whose loss or gradient norm is not finite."""

    def update(updates: Any, state: dict, params: Any = None, **extra: Any) -> tuple[Any, dict]:
        loss, grad_norm = extra.get("loss"), extra.get("grad_norm")
        if loss is None:  # MaxText calls without them when the wrapper has nothing to compare
            return spikes.update(updates, state, params, **extra)
        finite = jnp.isfinite(loss) if grad_norm is None else jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def take() -> tuple[Any, dict]:
            return spikes.update(updates, state, params, **dict(extra))  # MaxText pops from the dict it gets

        def skip() -> tuple[Any, dict]:
            shapes, _ = jax.eval_shape(take)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, {**state, "is_skipped": jnp.array(True)}

        return jax.lax.cond(finite, take, skip)

    return optax.GradientTransformationExtraArgs(spikes.init, update)


def install() -> None:
    """Make every `skip_step_on_spikes` wrapper MaxText builds from now on skip non-finite steps too."""
    from maxtext.optimizers import optimizers

    original = getattr(optimizers.skip_step_on_spikes, "maxtext_original", optimizers.skip_step_on_spikes)

    @functools.wraps(original)
    def wrapper(inner_opt: optax.GradientTransformation, interval: int, scaling_factor: float):
        return skipping_non_finite(original(inner_opt, interval, scaling_factor))

    wrapper.maxtext_original = original  # type: ignore[attr-defined]
    optimizers.skip_step_on_spikes = wrapper
