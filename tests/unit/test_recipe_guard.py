"""The recipe's `guard:` section: its checks, and the MaxText keys it sets."""

from __future__ import annotations

import pytest

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition
from maxtext_moe.recipe.validate import resolve

TINY = "deepseek3-tiny-cpu"
OWNED = ("skip_step_on_spikes", "skip_step_interval", "skip_step_scaling_factor", "abort_on_nan_loss")


def compose_resolve(*overrides: str):
    return resolve(composition.compose(TINY, list(overrides)))


def error_of(*overrides: str) -> str:
    with pytest.raises(UserError) as e:
        compose_resolve(*overrides)
    return str(e.value)


def test_the_default_stops_and_leaves_maxtexts_keys_alone():
    r = compose_resolve()
    assert r.guard_settings.action == "stop" and r.guard_settings.loss_spike is None
    assert not any(key in r.maxtext for key in OWNED)
    assert r.sources["guard.action"] == "default"
    assert compose_resolve("guard.loss_spike=off").guard_settings.loss_spike is None  # YAML 1.1 reads off as false


def test_a_spike_factor_turns_on_maxtexts_spike_wrapper_and_changes_the_checkpoint_identity():
    r = compose_resolve("guard.loss_spike=4", "guard.window=16")
    assert (r.maxtext["skip_step_on_spikes"], r.maxtext["skip_step_interval"]) == (True, 16)
    assert r.maxtext["skip_step_scaling_factor"] == 4.0
    assert r.sources["maxtext.skip_step_on_spikes"] == "derived from the guard section"
    # The wrapper nests the optimizer state: a checkpoint written without it cannot be resumed with it.
    assert r.checkpoint_identity()["optimizer"] != compose_resolve().checkpoint_identity()["optimizer"]
    assert compose_resolve("guard.window=16").checkpoint_identity() == compose_resolve().checkpoint_identity()


def test_skip_keeps_maxtext_from_exiting_on_a_nan_loss():
    r = compose_resolve("guard.action=skip", "guard.loss_spike=6")
    assert r.maxtext["abort_on_nan_loss"] is False and r.maxtext["abort_on_inf_loss"] is False
    assert "abort_on_nan_loss" not in compose_resolve("guard.loss_spike=6").maxtext  # stop: MaxText's abort stays


def test_rollback_keeps_maxtext_from_exiting_on_a_nan_loss():
    r = compose_resolve("guard.action=rollback")
    assert r.maxtext["abort_on_nan_loss"] is False and r.maxtext["abort_on_inf_loss"] is False
    assert "skip_step_on_spikes" not in r.maxtext


@pytest.mark.parametrize(
    "override, expected",
    [
        ("guard.action=retry", "guard.action: must be one of stop, skip, rollback, got 'retry'."),
        ("guard.loss_spike=-1", "guard.loss_spike: must be off or a number of standard deviations above 0"),
        ("guard.loss_spike=big", "guard.loss_spike: must be off or a number"),
        ("guard.window=4", "guard.window: must be a whole number of at least 8, got 4."),
        ("guard.max_rollbacks=0", "guard.max_rollbacks: must be a whole number of at least 1"),
        ("guard.action=skip", "guard.action: is skip, but guard.loss_spike is off"),
        ("skip_step_on_spikes=true", "skip_step_on_spikes: is set by the guard: section"),
        ("guard.windw=9", "guard.windw: unknown guard field. Did you mean 'window'?"),
    ],
)
def test_bad_guard_values_are_refused_naming_the_key_and_the_source(override, expected):
    error = error_of(override)
    assert error.startswith("command line: ") and expected in error


def test_rollback_needs_checkpoints():
    assert "guard.action: is rollback" in error_of("guard.action=rollback", "enable_checkpointing=false")
