"""The recipe's `job:` section: how a job of many processes restarts and when it counts as hung.

MaxText on GPUs has no in-job restart and no hang detection (its emergency checkpointing and elastic
training are TPU/Pathways only), and a process that stops arriving at a collective leaves the others
waiting until the allocation's wall clock. These values are read by the job `maxtext-moe launch` renders
(the restart loop) and by every training process (`run/watchdog.py`).

    job:
      max_restarts: 3      # restarts in the same allocation after a lost or hung process (0: none)
      watchdog: auto       # auto | off | seconds without a step before a process counts as hung
      first_step_s: 3600   # the watchdog's floor before the first step: start-up and compilation
      compile_cache: auto  # auto | run: <run folder>/jax_cache | off | a folder every node can read

`watchdog: auto` waits `AUTO_FACTOR` times the slowest step seen so far, and at least `AUTO_MIN_S`. The watchdog
runs in jobs of several processes, whose launcher restarts them. `compile_cache: auto` is the run folder for a job
of several GPU processes (a restart on other nodes finds it there), off for several CPU processes (`cache_dir`
says why), and MaxText's `jax_cache_dir` for one process.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.recipe.guard import Sourced

FIELDS = ("max_restarts", "watchdog", "first_step_s", "compile_cache")
AUTO_FACTOR = 10
AUTO_MIN_S = 300.0  # room for a synchronous checkpoint save, which the step hook sees as one long step


@dataclass(frozen=True)
class JobSettings:
    max_restarts: int = 3
    watchdog: float | str | None = "auto"  # "auto", seconds, or None: off
    first_step_s: float = 3600.0
    compile_cache: str = "auto"  # "auto", "run", "off" or a folder

    @property
    def watchdog_auto(self) -> bool:
        return self.watchdog == "auto"

    def timeout(self, slowest_step_s: float | None) -> float | None:
        """Seconds without a step before this process counts as hung; None: never. Before any step has
        completed (`slowest_step_s` None), the first-step floor."""
        if self.watchdog is None:
            return None
        if slowest_step_s is None:
            return self.first_step_s if self.watchdog_auto else max(self.first_step_s, float(self.watchdog))
        if self.watchdog_auto:
            return max(AUTO_MIN_S, AUTO_FACTOR * slowest_step_s)
        return float(self.watchdog)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSettings:
        return cls(**d)


def _seconds(value: Any, key: str, where: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UserError(f"must be a number of seconds above 0, got {value!r}.", key=f"job.{key}", source=where)
    return float(value)


def resolve(section: Mapping[str, Sourced]) -> JobSettings:
    """The checked `job:` section."""

    def where(key: str) -> str | None:
        return section[key].source if key in section else None

    default = JobSettings()
    restarts = section["max_restarts"].value if "max_restarts" in section else default.max_restarts
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 0:
        raise UserError(
            f"must be a whole number of at least 0, got {restarts!r}.",
            key="job.max_restarts",
            source=where("max_restarts"),
            fix="e.g. job.max_restarts=3, or 0 to end the job at the first lost or hung process.",
        )
    watchdog = section["watchdog"].value if "watchdog" in section else "auto"
    if watchdog is False or str(watchdog).lower() == "off":
        watchdog = None
    elif str(watchdog).lower() == "auto":
        watchdog = default.watchdog
    else:
        watchdog = _seconds(watchdog, "watchdog", where("watchdog"))
    first = (
        _seconds(section["first_step_s"].value, "first_step_s", where("first_step_s"))
        if "first_step_s" in section
        else None
    )
    cache = section["compile_cache"].value if "compile_cache" in section else default.compile_cache
    if cache is False:
        cache = "off"
    if not isinstance(cache, str) or not cache.strip():
        raise UserError(
            f"must be auto, run, off or a folder, got {cache!r}.",
            key="job.compile_cache",
            source=where("compile_cache"),
        )
    return JobSettings(
        max_restarts=restarts,
        watchdog=watchdog,
        first_step_s=default.first_step_s if first is None else first,
        compile_cache=cache,
    )


def cache_dir(settings: JobSettings, run: str, num_processes: int, cpu: bool, maxtext_default: str) -> str:
    """MaxText's `jax_cache_dir` for this run: "" leaves JAX's persistent compilation cache off.

    `auto` leaves it off for several CPU processes: JAX keys a CPU program by the process's own devices and only
    process 0 writes the cache, so process 0 alone skips compiling and reaches the first collective while the
    others still compile, past Gloo's 30 s wait."""
    choice = settings.compile_cache
    if choice == "auto":
        choice = maxtext_default if num_processes == 1 else ("off" if cpu else "run")
    return {"run": f"{run}/jax_cache", "off": ""}.get(choice, choice)


def check_step_time(settings: JobSettings, step_s: float | None, source: str) -> None:
    """Refuse a fixed watchdog timeout the planner says one step outlasts: it would end every healthy job."""
    if step_s is None or settings.watchdog is None or settings.watchdog_auto or float(settings.watchdog) > step_s:
        return
    raise UserError(
        f"is {settings.watchdog:g} s, but the planner puts one step of this recipe at {step_s:.1f} s: the watchdog "
        "would end a healthy job.",
        key="job.watchdog",
        source=source,
        fix=f"give more than {step_s:.0f} s (several steps), or job.watchdog=auto.",
    )
