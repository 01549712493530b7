"""The recipe's `training:` section: the run's length and every schedule, stated in tokens as papers state them.

MaxText's learning rate is one shape (warm-up, then cosine or warmup-stable-decay to `learning_rate_schedule_steps`)
counted in steps, and its bias-update rate, MTP weight and gradient accumulation are constants. DeepSeek-V3's
recipe (arXiv 2412.19437, sec. 4.2) has a multi-phase learning rate, a batch ramp, and a bias-update rate and MTP
weight that change part-way, all stated in tokens. This section states them once; `timeline.Timeline` lays them
out on steps, `maxtext_keys` sets the MaxText keys they imply, and `upstream/training_schedule.py` carries the
rest out in the step.

    training:
      tokens: 14.8T              # the run's budget (K, M, B, T suffixes, or a number)
      batch_start: 3072          # sequences per step at the start ...
      batch_end: 15360           # ... and after the ramp: per_device_batch_size x devices x gradient accumulation
      ramp_tokens: 469B          # the ramp is linear in tokens trained
      lr_peak: 2.2e-4
      lr_warmup_steps: 2000      # linear from 0
      lr_constant_until: 10T     # the peak holds until here ...
      lr_cosine_until: 14.3T     # ... then a cosine decay reaches lr_cosine_to here
      lr_cosine_to: 2.2e-5
      lr_tail: {14.633T: 7.3e-6}          # constants after the decay, from the tokens given
      bias_update_rate: {0: 0.001, 14.3T: 0}   # gamma, from the tokens given
      mtp_weight: {0: 0.3, 10T: 0.1}           # lambda, from the tokens given

The batch ramp runs every step at `batch_end` sequences and masks the loss of the sequences past the step's
batch: the gradient is the smaller batch's, and the step costs a full one (`Timeline.extra_compute`).
MaxText's `steps` may be set below the schedule's length to stop early (a smoke run); the schedule is unchanged.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, NoReturn

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.guard import Sourced
from maxtext_moe.recipe.maxtext_keys import refuse_owned
from maxtext_moe.recipe.timeline import Timeline

FIELDS = (
    "tokens",
    "batch_start",
    "batch_end",
    "ramp_tokens",
    "lr_peak",
    "lr_warmup_steps",
    "lr_constant_until",
    "lr_cosine_until",
    "lr_cosine_to",
    "lr_tail",
    "bias_update_rate",
    "mtp_weight",
)
REQUIRED = ("tokens", "batch_end", "lr_peak", "lr_constant_until", "lr_cosine_until", "lr_cosine_to")
# MaxText keys whose job this section does: set beside it, they would be silently replaced.
OWNED = (
    "learning_rate",
    "learning_rate_schedule_steps",
    "warmup_steps_fraction",
    "lr_schedule_type",
    "learning_rate_final_fraction",
    "wsd_decay_steps_fraction",
    "wsd_decay_style",
    "gradient_accumulation_steps",
    "enable_rampup_batch_size",
)
# MaxText keys the section sets that a model fragment may state too, if it agrees (the rate the step scales).
AGREED = {"bias_update_rate": "routed_bias_update_rate", "mtp_weight": "mtp_loss_scaling_factor"}
_SUFFIX = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
_AMOUNT = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMBT]?)\s*")


@dataclass(frozen=True)
class TrainingSettings:
    tokens: float
    batch_start: int
    batch_end: int
    ramp_tokens: float
    lr_peak: float
    lr_warmup_steps: int
    lr_constant_until: float
    lr_cosine_until: float
    lr_cosine_to: float
    lr_tail: tuple[tuple[float, float], ...]
    bias_update_rate: tuple[tuple[float, float], ...]
    mtp_weight: tuple[tuple[float, float], ...]
    seq_len: int  # MaxText's max_target_length
    quantum: int  # the ramp's step in sequences: one per device
    accumulation: int  # gradient_accumulation_steps: batch_end over the sequences one step of the mesh holds

    def timeline(self) -> Timeline:
        return Timeline(
            tokens=self.tokens,
            seq_len=self.seq_len,
            batch_start=self.batch_start,
            batch_end=self.batch_end,
            ramp_tokens=self.ramp_tokens,
            quantum=self.quantum,
            lr_peak=self.lr_peak,
            warmup_steps=self.lr_warmup_steps,
            lr_constant_until=self.lr_constant_until,
            lr_cosine_until=self.lr_cosine_until,
            lr_cosine_to=self.lr_cosine_to,
            lr_tail=self.lr_tail,
            bias_update_rate=self.bias_update_rate,
            mtp_weight=self.mtp_weight,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainingSettings:
        pairs = ("lr_tail", "bias_update_rate", "mtp_weight")
        return cls(**{k: tuple(tuple(p) for p in v) if k in pairs else v for k, v in d.items()})


def amount(value: Any) -> float | None:
    """A token count as written in a recipe: a number, or text like `14.8T`, `469B`, `1e12`; None if neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    m = _AMOUNT.fullmatch(str(value).upper())
    return float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0) if m else None


class _Reader:
    """Reads the section's fields, each error naming `training.<field>` and the file that set it."""

    def __init__(self, section: Mapping[str, Sourced], fallback: str) -> None:
        self.section, self.fallback = section, fallback

    def where(self, key: str) -> str:
        return self.section[key].source if key in self.section else self.fallback

    def fail(self, key: str, message: str, fix: str | None = None) -> NoReturn:
        raise UserError(message, key=f"training.{key}", source=self.where(key), fix=fix)

    def number(self, key: str, default: float = 0.0, *, positive: bool = False) -> float:
        if key not in self.section:
            return float(default)
        value = self.section[key].value
        got = amount(value)
        if got is None or got < 0 or (positive and got == 0):
            self.fail(key, f"must be a number {'above' if positive else 'of at least'} 0, got {value!r}.")
        return float(got)

    def whole(self, key: str, default: int = 0) -> int:
        got = self.number(key, default, positive=key != "lr_warmup_steps")
        if not got.is_integer():
            self.fail(key, f"must be a whole number, got {got:g}.")
        return int(got)

    def step_function(self, key: str) -> tuple[tuple[float, float], ...]:
        """A step function `{from tokens: value}` (0 throughout when the field is missing); values at least 0."""
        if key not in self.section:
            return ((0.0, 0.0),)
        value = self.section[key].value
        if not isinstance(value, Mapping) or not value:
            self.fail(key, f"must be a mapping of tokens to values, like {{0: 0.001, 14.3T: 0}}; got {value!r}.")
        pairs = []
        for t, v in value.items():
            tok, val = amount(t), amount(v)
            if tok is None or val is None or val < 0:
                self.fail(key, f"has {t!r}: {v!r}; tokens and values must be numbers of at least 0.")
            pairs.append((float(tok), float(val)))
        return tuple(pairs)


def _increasing(read: _Reader, key: str, points: list[float], what: str) -> None:
    if any(b <= a for a, b in itertools.pairwise(points)):
        read.fail(key, f"{what} must increase, got {', '.join(f'{p:g}' for p in points)}.")


def resolve(
    section: Mapping[str, Sourced],
    value: Callable[[str], Any],
    source: Callable[[str], str | None],
    num_devices: int,
    recipe: str,
) -> TrainingSettings:
    """The checked section; `value(key)` is a MaxText key's effective value, `source(key)` the file that set it
    (None when no recipe file or override did)."""
    read = _Reader(section, recipe)
    refuse_owned(
        OWNED, source, "training", "remove it; the training section states the schedule (docs/RECIPES.md, 'Training')."
    )
    for key in REQUIRED:
        if key not in section:
            read.fail(key, "is missing: a training section states it.", "see docs/RECIPES.md, 'Training'.")
    tokens = read.number("tokens", positive=True)
    end = read.whole("batch_end")
    start = read.whole("batch_start", end)
    ramp = read.number("ramp_tokens", 0.0)
    per_step = float(value("per_device_batch_size")) * num_devices
    accumulation = end / per_step
    if not accumulation.is_integer():
        read.fail(
            "batch_end",
            f"is {end} sequences, not a whole number of steps of per_device_batch_size x devices = {per_step:g}: "
            "gradient accumulation cannot reach it.",
            f"give a multiple of {per_step:g} (e.g. {max(1, round(accumulation)) * per_step:g}), or change "
            "per_device_batch_size or the topology.",
        )
    if start > end or start % num_devices:
        read.fail(
            "batch_start",
            f"is {start}; the ramp needs a whole number of sequences per device ({num_devices} devices) up to "
            f"batch_end ({end}).",
            f"give a multiple of {num_devices} of at most {end}.",
        )
    if ramp >= tokens:
        read.fail("ramp_tokens", f"is {ramp:g}, as long as the run or longer ({tokens:g} tokens).", "shorten the ramp.")
    if ramp == 0 and start != end:
        read.fail("ramp_tokens", f"is 0 but batch_start ({start}) differs from batch_end ({end}).")
    lr_points = [read.number(k) for k in ("lr_constant_until", "lr_cosine_until")]
    tail = read.step_function("lr_tail") if "lr_tail" in section else ()
    _increasing(
        read,
        "lr_cosine_until",
        [*lr_points, *(t for t, _ in tail), tokens],
        "lr_constant_until, lr_cosine_until, lr_tail's tokens and the run's tokens",
    )
    schedules = {k: read.step_function(k) for k in ("bias_update_rate", "mtp_weight")}
    for key, pairs in schedules.items():
        if pairs[0][0] != 0:
            read.fail(key, f"starts at {pairs[0][0]:g} tokens; the first value must be from 0.")
        _increasing(read, key, [*(t for t, _ in pairs), tokens], "its tokens (and then the run's)")
    settings = TrainingSettings(
        tokens=tokens,
        batch_start=start,
        batch_end=end,
        ramp_tokens=ramp,
        lr_peak=read.number("lr_peak", positive=True),
        lr_warmup_steps=read.whole("lr_warmup_steps", 0),
        lr_constant_until=lr_points[0],
        lr_cosine_until=lr_points[1],
        lr_cosine_to=read.number("lr_cosine_to"),
        lr_tail=tail,
        bias_update_rate=schedules["bias_update_rate"],
        mtp_weight=schedules["mtp_weight"],
        seq_len=int(value("max_target_length")),
        quantum=num_devices,
        accumulation=int(accumulation),
    )
    line = settings.timeline()
    for field, key in AGREED.items():
        derived = max(v for _, v in getattr(settings, field))
        if source(key) and float(value(key)) != derived:
            raise UserError(
                f"is {value(key)}, but training.{field} makes it {derived:g} (its largest value).",
                key=key,
                source=source(key),
                fix=f"remove it, or state the value in training.{field}.",
            )
    if source("steps") and int(value("steps")) > line.steps:
        raise UserError(
            f"is {value('steps')}, past the {line.steps} steps the training section's {settings.tokens:g} tokens take.",
            key="steps",
            source=source("steps"),
            fix="leave steps out to train the whole schedule, or raise training.tokens.",
        )
    if settings.lr_warmup_steps > line.step_at(settings.lr_constant_until):
        read.fail(
            "lr_warmup_steps",
            f"is {settings.lr_warmup_steps}, past step {line.step_at(settings.lr_constant_until)} where the "
            "cosine decay starts (lr_constant_until).",
        )
    return settings


def maxtext_keys(settings: TrainingSettings, steps_set: int | None) -> dict[str, Any]:
    """The MaxText keys the section implies. `steps_set` is a `steps` the recipe gave (a shorter run), or None.

    The bias-update rate and MTP weight are their schedules' largest values: the step scales them by the value
    of the step over it (`upstream/training_schedule.py`), and MaxText computes the bias update only above 0."""
    line = settings.timeline()
    return {
        "steps": line.steps if steps_set is None else steps_set,
        "learning_rate": settings.lr_peak,
        "learning_rate_schedule_steps": line.steps,
        "gradient_accumulation_steps": settings.accumulation,
        "routed_bias_update_rate": max(v for _, v in settings.bias_update_rate),
        "mtp_loss_scaling_factor": max(v for _, v in settings.mtp_weight),
    }


def tokens_text(tokens: float) -> str:
    """`14.8T`, `469B`: token counts as the section's fields are written."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.6g}{suffix}"
    return f"{tokens:g}"


def show_lines(settings: TrainingSettings, sources: Mapping[str, str], steps: int) -> list[str]:
    """The section's fields with their files, then every breakpoint on the run's steps: what `show` prints.
    `steps` is MaxText's, where this run stops."""
    line = settings.timeline()
    lines = ["training:"]
    for key in FIELDS:
        raw = getattr(settings, key)
        text = (
            "{" + ", ".join(f"{tokens_text(t)}: {v:g}" for t, v in raw) + "}"
            if isinstance(raw, tuple)
            else (tokens_text(raw) if key in ("tokens", "ramp_tokens", "lr_constant_until", "lr_cosine_until") else raw)
        )
        lines.append(f"  {(key + ':').ljust(19)} {text}  # {sources.get(f'training.{key}', 'default')}")
    lines.append(
        f"# the schedule on steps ({settings.seq_len} tokens a sequence; tokens trained before each step; "
        "lr from lr_*, batch from batch_*, gamma from bias_update_rate, lambda from mtp_weight):"
    )
    lines.append(f"#   {'step':>8} {'tokens':>10} {'lr':>9} {'batch':>6} {'gamma':>7} {'lambda':>6}  what starts")
    for step, what in line.breakpoints():
        lines.append(
            f"#   {step:>8} {tokens_text(line.tokens_at(step)):>10} {line.lr_at(step):>9.3g} {line.batch_at(step):>6} "
            f"{line.bias_rate_at(step):>7g} {line.mtp_weight_at(step):>6g}  {what}"
        )
    if line.ramp_steps:
        lines.append(
            f"# batch ramp: {len(line.levels) - 1} batch sizes below batch_end over steps 0-{line.ramp_steps - 1}, "
            f"in steps of {settings.quantum} sequences (one per device). Deviation: every step computes batch_end "
            f"({settings.batch_end}) sequences and masks the loss of those past its batch, so the gradient is the "
            f"ramp's, no step recompiles, and the masked sequences add {100 * line.extra_compute():.1f}% to the "
            "run's compute and are not trained on."
        )
    lines.append(
        f"# batch_end {settings.batch_end} = per-step batch {settings.batch_end // settings.accumulation} x "
        f"gradient accumulation {settings.accumulation}."
    )
    if steps < line.steps:
        lines.append(
            f"# this run stops after step {steps} of the schedule's {line.steps} (steps, "
            f"{sources.get('maxtext.steps', 'command line')}); the schedule's values are those above."
        )
    return lines
