"""A training schedule stated in tokens, laid out on the run's steps.

DeepSeek-V3's recipe (and most pre-training recipes) states its phases in tokens, while MaxText and optax count
steps. The two differ while the batch ramps up: a step then trains fewer tokens. `Timeline` is that mapping and
the value of every schedule at any step, in plain Python (the resolver, `show` and `plan` never import jax);
`upstream/training_schedule.py` builds the same functions for the jitted step from the same numbers, and a test
checks the two agree.

The batch ramp: the batch (in sequences) grows linearly in the tokens trained so far, from `batch_start` to
`batch_end` over `ramp_tokens`, in whole `quantum`s (one sequence per device), and stays at `batch_end` after.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Timeline:
    tokens: float  # the run's budget: tokens trained in all
    seq_len: int
    batch_start: int  # sequences per step at the start of the ramp
    batch_end: int  # sequences per step after it
    ramp_tokens: float
    quantum: int  # the ramp's batch moves in whole multiples of this many sequences
    lr_peak: float
    warmup_steps: int
    lr_constant_until: float  # tokens: the peak holds until here ...
    lr_cosine_until: float  # ... then a cosine decay reaches lr_cosine_to here
    lr_cosine_to: float
    lr_tail: tuple[tuple[float, float], ...] = ()  # (from tokens, constant lr) after the decay
    bias_update_rate: tuple[tuple[float, float], ...] = ((0.0, 0.0),)  # (from tokens, gamma)
    mtp_weight: tuple[tuple[float, float], ...] = ((0.0, 0.0),)  # (from tokens, lambda)
    # the ramp as levels: (first step, batch), and the tokens trained before each level's first step
    _levels: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)
    _level_tokens: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        levels: list[tuple[int, int]] = []
        before: list[float] = []
        trained, step = 0.0, 0
        while trained < self.ramp_tokens:
            batch = self._ramp_batch(trained)
            if not levels or levels[-1][1] != batch:
                levels.append((step, batch))
                before.append(trained)
            trained += batch * self.seq_len
            step += 1
        levels.append((step, self.batch_end))
        before.append(trained)
        object.__setattr__(self, "_levels", tuple(levels))
        object.__setattr__(self, "_level_tokens", tuple(before))

    def _ramp_batch(self, trained: float) -> int:
        grown = self.batch_start + (self.batch_end - self.batch_start) * trained / self.ramp_tokens
        return min(self.batch_end, max(self.batch_start, int(grown // self.quantum) * self.quantum))

    @property
    def levels(self) -> tuple[tuple[int, int], ...]:
        """The batch ramp: (first step, sequences per step), the last one `batch_end` for the rest of the run."""
        return self._levels

    @property
    def ramp_steps(self) -> int:
        return self._levels[-1][0]

    @property
    def steps(self) -> int:
        """The steps that train `tokens`: the last step may overshoot by less than one batch."""
        return self.step_at(self.tokens)

    def _level(self, step: int) -> int:
        return bisect.bisect_right([s for s, _ in self._levels], step) - 1

    def batch_at(self, step: int) -> int:
        return self._levels[self._level(step)][1]

    def tokens_at(self, step: int) -> float:
        """Tokens trained before `step` (step 0 starts at 0)."""
        i = self._level(step)
        first, batch = self._levels[i]
        return self._level_tokens[i] + (step - first) * batch * self.seq_len

    def step_at(self, tokens: float) -> int:
        """The first step that starts with at least `tokens` trained: where a phase stated in tokens begins."""
        last = len(self._levels) - 1
        for i, ((first, batch), before) in enumerate(zip(self._levels, self._level_tokens, strict=True)):
            if i == last or self._level_tokens[i + 1] >= tokens:
                return first + max(0, math.ceil((tokens - before) / (batch * self.seq_len)))
        raise AssertionError("unreachable: the last level is open-ended")

    def lr_at(self, step: int) -> float:
        """The learning rate of `step`: linear warm-up from 0, the peak, a cosine decay, then constants."""
        if step < self.warmup_steps:
            return self.lr_peak * step / self.warmup_steps
        start, end = self.step_at(self.lr_constant_until), self.step_at(self.lr_cosine_until)
        if step < start:
            return self.lr_peak
        if step < end:
            cos = 0.5 * (1 + math.cos(math.pi * (step - start) / (end - start)))
            return self.lr_cosine_to + (self.lr_peak - self.lr_cosine_to) * cos
        return piecewise(self.lr_steps_tail(), step, self.lr_cosine_to)

    def lr_steps_tail(self) -> tuple[tuple[int, float], ...]:
        return tuple((self.step_at(t), v) for t, v in self.lr_tail)

    def bias_steps(self) -> tuple[tuple[int, float], ...]:
        return tuple((self.step_at(t), v) for t, v in self.bias_update_rate)

    def mtp_steps(self) -> tuple[tuple[int, float], ...]:
        return tuple((self.step_at(t), v) for t, v in self.mtp_weight)

    def bias_rate_at(self, step: int) -> float:
        return piecewise(self.bias_steps(), step, 0.0)

    def mtp_weight_at(self, step: int) -> float:
        return piecewise(self.mtp_steps(), step, 0.0)

    def extra_compute(self) -> float:
        """The compute the ramp's masked sequences add, over that of the tokens trained: each step runs at
        `batch_end`."""
        computed = self.steps * self.batch_end * self.seq_len
        return computed / self.tokens_at(self.steps) - 1.0

    def breakpoints(self) -> list[tuple[int, str]]:
        """(step, what starts there), in step order: every point where a schedule changes course."""
        points = [(0, "start")]
        if self.warmup_steps:
            points.append((self.warmup_steps, "lr warm-up ends"))
        if self.ramp_steps:
            points.append((self.ramp_steps, "batch ramp ends"))
        points.append((self.step_at(self.lr_constant_until), "lr cosine decay starts"))
        points.append((self.step_at(self.lr_cosine_until), "lr cosine decay ends"))
        points += [(s, f"lr {v:g}") for s, v in self.lr_steps_tail()]
        points += [(s, f"bias update rate {v:g}") for s, v in self.bias_steps()[1:]]
        points += [(s, f"MTP weight {v:g}") for s, v in self.mtp_steps()[1:]]
        points.append((self.steps, "end"))
        return sorted(points, key=lambda p: p[0])


def piecewise(points: tuple[tuple[int, float], ...], step: int, before: float) -> float:
    """The value of a step function given as (first step, value) pairs in step order; `before` before the first."""
    value = before
    for first, v in points:
        if step >= first:
            value = v
    return value
