"""The recipe's `guard:` section: what a diverging run does, checked before anything runs.

MaxText has the pieces but no policy: `skip_step_on_spikes` (an optax wrapper that zeroes a step's
update and keeps the optimizer state when the loss or the gradient norm exceeds the mean plus
`skip_step_scaling_factor` standard deviations of the last `skip_step_interval` steps) and
`abort_on_nan_loss` / `abort_on_inf_loss` (`sys.exit(1)` with a line in its log). This section names
the action once and sets those keys; `run/divergence.py` carries the action out.

    guard:
      action: stop        # stop (default) | skip | rollback
      loss_spike: off     # off (default) | k: a spike is a loss or gradient norm above mean + k std
      window: 128         # the steps whose mean and std define a spike (MaxText's skip_step_interval)
      max_rollbacks: 3    # rollback: how many times one `train` command may roll back before it stops
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import maxtext_keys

ACTIONS = ("stop", "skip", "rollback")
FIELDS = ("action", "loss_spike", "window", "max_rollbacks")
# MaxText keys this section sets; a recipe that set them directly would fight it.
OWNED = (
    "skip_step_on_spikes",
    "skip_step_interval",
    "skip_step_scaling_factor",
    "abort_on_nan_loss",
    "abort_on_inf_loss",
)
# MaxText's wrapper checks from step window//2 on, against the steps before it: 8 gives it 3 to compare with.
MIN_WINDOW = 8


class Sourced(Protocol):
    value: Any
    source: str


@dataclass(frozen=True)
class GuardSettings:
    action: str = "stop"
    loss_spike: float | None = None  # None: spikes are not looked for
    window: int = 128
    max_rollbacks: int = 3

    def maxtext_keys(self) -> dict[str, Any]:
        """The MaxText keys that carry this out: the spike wrapper, and no abort where a skip or a rollback follows."""
        keys: dict[str, Any] = {}
        if self.loss_spike is not None:
            keys |= {
                "skip_step_on_spikes": True,
                "skip_step_interval": self.window,
                "skip_step_scaling_factor": self.loss_spike,
            }
        # skip: the wrapper skips a non-finite step too (`upstream.skip_nonfinite`) and the run goes on;
        # rollback: the run must reach a checkpoint past the bad batch, not exit at it.
        if self.action in ("skip", "rollback"):
            keys |= {"abort_on_nan_loss": False, "abort_on_inf_loss": False}
        return keys

    def sources(self, given: Mapping[str, str]) -> dict[str, str]:
        """Where each field and each MaxText key it sets comes from, beside the `given` sources."""
        derived = {f"maxtext.{k}": "derived from the guard section" for k in self.maxtext_keys()}
        return derived | {f"guard.{k}": given.get(f"guard.{k}", "default") for k in asdict(self)}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GuardSettings:
        return cls(**d)


def _off(value: Any) -> bool:
    return value is None or value is False or (isinstance(value, str) and value.lower() == "off")


def _whole(value: Any, least: int, key: str, where: str | None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise UserError(f"must be a whole number of at least {least}, got {value!r}.", key=f"guard.{key}", source=where)
    return value


def resolve(
    section: Mapping[str, Sourced], maxtext_value: Callable[[str], Any], maxtext_source: Callable[[str], str | None]
) -> GuardSettings:
    """The checked `guard:` section. `maxtext_value(key)` is a MaxText key's effective value and
    `maxtext_source(key)` where the recipe set it (None when it did not)."""

    def where(key: str) -> str | None:
        return section[key].source if key in section else None

    maxtext_keys.refuse_owned(
        OWNED,
        maxtext_source,
        "guard",
        "remove it and set guard.action / guard.loss_spike / guard.window instead (docs/RECIPES.md).",
    )
    action = section["action"].value if "action" in section else "stop"
    if action not in ACTIONS:
        raise UserError(
            f"must be one of {', '.join(ACTIONS)}, got {action!r}.", key="guard.action", source=where("action")
        )
    spike = section["loss_spike"].value if "loss_spike" in section else None
    if _off(spike):
        spike = None
    elif isinstance(spike, bool) or not isinstance(spike, (int, float)) or not spike > 0:
        raise UserError(
            f"must be off or a number of standard deviations above 0, got {spike!r}.",
            key="guard.loss_spike",
            source=where("loss_spike"),
            fix="e.g. guard.loss_spike=6 (MaxText's default factor), or off.",
        )
    default = GuardSettings()
    window = _whole(section["window"].value, MIN_WINDOW, "window", where("window")) if "window" in section else None
    rollbacks = (
        _whole(section["max_rollbacks"].value, 1, "max_rollbacks", where("max_rollbacks"))
        if ("max_rollbacks" in section)
        else None
    )
    if action == "skip" and spike is None:
        raise UserError(
            "is skip, but guard.loss_spike is off: skip applies to the steps MaxText's spike check rejects.",
            key="guard.action",
            source=where("action"),
            fix="set guard.loss_spike (e.g. 6), or guard.action: stop.",
        )
    if action == "rollback" and not (maxtext_value("enable_checkpointing") and maxtext_value("enable_autocheckpoint")):
        raise UserError(
            "is rollback, which restores the last good checkpoint and takes the data position from the checkpoint "
            "saved when the run is stopped; this recipe has enable_checkpointing or enable_autocheckpoint off.",
            key="guard.action",
            source=where("action"),
            fix="turn both on (configs/checkpoint/frequent.yml), or use guard.action: stop.",
        )
    return GuardSettings(
        action=action,
        loss_spike=None if spike is None else float(spike),
        window=default.window if window is None else window,
        max_rollbacks=default.max_rollbacks if rollbacks is None else rollbacks,
    )
