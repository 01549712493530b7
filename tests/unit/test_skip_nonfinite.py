"""A non-finite step under MaxText's spike wrapper: skipped, and the window that judges later steps untouched."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from maxtext.optimizers import optimizers

from maxtext_moe.upstream import skip_nonfinite

WINDOW = 8


def _steps(tx, losses):
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    out = []
    for loss in losses:
        grads = {"w": jnp.full(3, 0.5)}
        updates, state = tx.update(grads, state, params, loss=jnp.float32(loss), grad_norm=jnp.float32(1.0))
        params = optax.apply_updates(params, updates)
        out.append((np.asarray(updates["w"]), bool(state["is_skipped"]), np.asarray(state["losses"])))
    return out


def test_maxtext_alone_keeps_the_nan_in_its_window_and_skips_the_next_finite_step():
    tx = optimizers.skip_step_on_spikes(optax.sgd(0.1), interval=WINDOW, scaling_factor=6.0)
    *_, (_, skipped_after, window) = _steps(tx, [2.0, 2.1, 1.9, 2.0, 2.05, float("nan"), 2.0])
    assert skipped_after and np.isnan(window).any()  # the gap this module fills


def test_a_nan_step_is_skipped_and_the_next_finite_step_trains():
    tx = skip_nonfinite.skipping_non_finite(
        optimizers.skip_step_on_spikes(optax.sgd(0.1), interval=WINDOW, scaling_factor=6.0)
    )
    steps = _steps(tx, [2.0, 2.1, 1.9, 2.0, 2.05, float("nan"), float("inf"), 2.0])
    (u_nan, skipped_nan, window_nan), (u_inf, skipped_inf, _), (u_next, skipped_next, window_next) = steps[5:]
    assert skipped_nan and skipped_inf and not (u_nan.any() or u_inf.any())
    assert np.array_equal(window_nan, steps[4][2])  # the window did not take the NaN
    assert not skipped_next and np.allclose(u_next, -0.05) and np.isfinite(window_next).all()


def test_install_wraps_what_maxtext_builds_once():
    try:
        skip_nonfinite.install()
        skip_nonfinite.install()
        tx = optimizers.skip_step_on_spikes(optax.sgd(0.1), interval=WINDOW, scaling_factor=6.0)
        _, skipped, _ = _steps(tx, [2.0, 2.1, 1.9, 2.0, float("nan")])[-1]
        assert skipped
        assert optimizers.skip_step_on_spikes.maxtext_original.__module__ == "maxtext.optimizers.optimizers"
    finally:
        optimizers.skip_step_on_spikes = optimizers.skip_step_on_spikes.maxtext_original
