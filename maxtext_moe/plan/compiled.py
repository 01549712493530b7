"""`plan RECIPE --compile`: the planner's per-GPU memory beside XLA's own, from compiling the real training step.

The analytical plan (`memory`) is arithmetic; XLA's buffer assignment is what a run gets. This compiles
the step MaxText trains for the recipe's full device count without those devices (`upstream.aot`, in a
subprocess that gets the recipe's environment before jax starts) and sets `compiled.memory_analysis()`
beside the plan, on the route `compile_route` chooses for this machine (mock GPU topology, XLA:GPU
deviceless, or XLA:CPU devices).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.plan import (
    compile_route,
    exchange_overlap,
    layout,
    memory,
    memory_traffic,
    peak,
    remat_gemms,
    scheduler_limit,
)
from maxtext_moe.plan.model import Model
from maxtext_moe.recipe import composition, maxtext_keys, validate, xla_flags
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.upstream import deviceless

GIB = 2**30
# A 671B step compiled for more than 18 minutes on an H200 host (docs/PLAN.md) and longer on a small CPU
# machine; a compile shows progress every PROGRESS_EVERY_S and stops on Ctrl-C, so the limit only ends a hang.
COMPILE_TIMEOUT_S = 4 * 3600
PROGRESS_EVERY_S = 30.0
# Where the recipe's XLA flags ask for the HLO dump; with one, the result names what is alive at the peak.
_DUMP_TO = re.compile(r"--xla_dump_to=(\S+)")
# JAX's own phase timings, logged by `upstream.aot` with `jax_log_compiles` on.
_PHASE = re.compile(r"Finished ([^\n]*?) in ([0-9.]+) sec")


def _env(compiled: ResolvedRecipe, route: compile_route.Route) -> dict[str, str]:
    env = dict(os.environ, **compiled.env)
    env.setdefault("MAXTEXT_ASSETS_ROOT", str(maxtext_keys.assets_dir()))
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if route.name == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        env["XLA_FLAGS"] = " ".join([*flags, route.env["XLA_FLAGS"]])
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.update(route.env)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # nothing runs: leave the GPU's memory alone
    return env


def _wait(proc: subprocess.Popen, seconds: float) -> int | None:
    """The process's exit status, or None if it still runs after `seconds`."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _say_progress(out: Callable[[str], None], name: str, seconds: float, log: Path) -> None:
    """One line while a compile runs: the time so far and the last phase JAX finished (`jax_log_compiles`)."""
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    phases = _PHASE.findall(text)
    last = f"; last finished: {phases[-1][0]} ({float(phases[-1][1]):.0f} s)" if phases else ""
    out(f"  compiling {name}: {seconds:.0f} s{last}")


def compile_in_subprocess(
    compiled: ResolvedRecipe,
    route: compile_route.Route,
    timeout_s: int = COMPILE_TIMEOUT_S,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    every_s: float = PROGRESS_EVERY_S,
) -> dict:
    """Run `upstream.aot` on `compiled` in a fresh Python; its log stays in a temporary folder on failure.
    A 671B compile takes many minutes, so `progress` gets a line every `every_s` seconds. The result also
    holds the `XLA_FLAGS` the compile ran with (`xla_flags`), which set the scheduler's budget."""
    xla_flags.check(compiled)
    env = _env(compiled, route)
    hw = compiled.topology.profile
    work = Path(tempfile.mkdtemp(prefix="maxtext-moe-compile-"))
    request = {
        "maxtext": compiled.maxtext,
        "sources": compiled.sources,
        "moe": compiled.moe,
        "attention": compiled.attention,
        "num_devices": compiled.topology.num_devices,
        "mock_gpu_topology": route.mock_gpu_topology,
        "deviceless": {
            "hardware": hw.name,
            "topology": route.deviceless_topology,
            "memory_bytes": scheduler_limit.allocator_bytes(deviceless.device_memory_bytes(hw), env),
        }
        if route.deviceless_topology
        else None,
    }
    (work / "request.json").write_text(json.dumps(request, default=str), encoding="utf-8")
    log = work / "compile.log"
    cmd = [sys.executable, "-m", "maxtext_moe.upstream.aot", str(work / "request.json"), str(work / "result.json")]
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            while _wait(proc, min(every_s, max(0.0, start + timeout_s - time.monotonic()))) is None:
                if time.monotonic() - start >= timeout_s:
                    raise UserError(
                        f"compiling {compiled.name} for {compiled.topology.num_devices} devices took over "
                        f"{timeout_s} s.",
                        key="--compile",
                        fix=f"compile a smaller layout, or on a machine with an NVIDIA GPU; the log is {log}.",
                    )
                _say_progress(progress, compiled.name, time.monotonic() - start, log)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0:
        raise UserError(
            f"compiling {compiled.name}'s training step failed: {_failure(log, proc.returncode)}",
            key="--compile",
            fix=f"the full log is {log}.",
        )
    result = json.loads((work / "result.json").read_text(encoding="utf-8"))
    shutil.rmtree(work, ignore_errors=True)
    return result | {"xla_flags": env.get("XLA_FLAGS", ""), "allocator_env": _allocator_env(env)}


def _allocator_env(env: dict[str, str]) -> dict[str, str]:
    """The settings of JAX's GPU allocator the compile ran with, whose limit XLA budgeted from."""
    return {k: env[k] for k in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR") if k in env}


def _failure(log: Path, returncode: int) -> str:
    """Why the compile's process ended: the signal that killed it (XLA crashes in native code, where the log
    ends mid-phase with no error), else the exception it ended with."""
    if returncode < 0:
        name = signal.Signals(-returncode).name
        hint = {
            "SIGSEGV": "XLA's compiler crashed; docs/UPSTREAM.md lists the crashes known and their workarounds",
            "SIGABRT": "XLA's compiler aborted; the log's last lines say where",
            "SIGKILL": "killed, most often by the kernel's out-of-memory killer: the compile needs more host memory",
        }.get(name, "killed")
        return f"the compile process died of {name} ({hint})"
    return _last_error(log) or f"exit {returncode}"


def _last_error(log: Path) -> str:
    """The exception a failed compile ended with (its type and message), else the log's last line."""
    lines = [ln.strip() for ln in log.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Exhausted)\b:", ln)]
    return (errors or lines or [""])[-1].removeprefix("maxtext_moe.errors.UserError: ")


def device_total(mem: dict[str, int], prefix: str = "") -> int:
    """What one device must hold for the step: arguments + outputs + temporaries - donated (aliased), + code."""
    plus = ("argument_size", "output_size", "temp_size", "generated_code_size")
    return sum(mem.get(prefix + k, 0) for k in plus) - mem.get(prefix + "alias_size", 0)


@dataclass(frozen=True)
class CompiledPlan:
    recipe: str
    route: compile_route.Route
    planned: memory.Memory
    planned_layout: str
    result: dict[str, Any]
    at_peak: peak.Peak | None = None  # from the HLO dump, when the recipe's XLA flags asked for one
    peak_note: str = ""  # why a dump asked for gave no peak
    limit: scheduler_limit.SchedulerLimit | None = None  # XLA:GPU's scheduler budget, for the recipe's GPU kind
    exchange: exchange_overlap.ExchangeOverlap | None = None  # what runs inside each all-to-all (HLO dump)
    remat: remat_gemms.RematGemms | None = None  # GEMM work XLA recomputes to fit memory (HLO dump)
    traffic: memory_traffic.MemoryTraffic | None = None  # bytes the memory-bound kernels move (HLO dump)

    @property
    def compiled_total(self) -> int:
        return device_total(self.result["memory"])

    @property
    def planned_state(self) -> float:
        """Parameters and AdamW state the plan puts on one device: the step's state argument."""
        return sum(v for k, v in self.planned.device.items() if k.startswith(("parameters", "optimizer state")))

    def to_json(self) -> dict[str, Any]:
        mem = self.result["memory"]
        return {
            "recipe": self.recipe,
            "route": self.route.name,
            "route_description": self.route.description,
            "compiled_with_overrides": list(self.route.overrides),
            "compiled": dict(
                self.result, device_total_bytes=self.compiled_total, host_total_bytes=device_total(mem, "host_")
            ),
            "planned": {
                "layout": self.planned_layout,
                "memory_per_gpu_bytes": self.planned.device_total,
                "memory_breakdown_bytes": self.planned.device,
                "host_memory_per_gpu_bytes": self.planned.host_total,
                "state_bytes": self.planned_state,
            },
            "compiled_over_planned": self.compiled_total / self.planned.device_total,
            "state_compiled_over_planned": self.result["state_bytes"] / self.planned_state,
            "at_peak": asdict(self.at_peak) if self.at_peak else None,
            "scheduler_limit": self.limit.to_json(self.planned.device_total)
            | {"fit": self.limit.fit(self.compiled_total)}
            if self.limit
            else None,
            "exchange_overlap": self.exchange.to_json() if self.exchange else None,
            "remat_gemms": self.remat.to_json() if self.remat else None,
            "memory_traffic": self.traffic.to_json() if self.traffic else None,
        }

    def render(self) -> str:
        mem, res = self.result["memory"], self.result
        names = ("argument_size", "output_size", "temp_size", "alias_size", "generated_code_size")
        parts = ", ".join(f"{n.removesuffix('_size').replace('_', ' ')} {mem.get(n, 0) / GIB:.2f}" for n in names)
        host = device_total(mem, "host_")
        mesh = " x ".join(f"{k} {v}" for k, v in res["mesh"].items() if v > 1) or "one device"
        lines = [
            f"plan {self.recipe} --compile: {self.route.description}",
            f"  compiled in {res['compile_s']:.0f} s for {res['devices']} {res['device_kind']} devices "
            f"({res['processes']} process(es)), mesh {mesh}",
            f"  XLA memory per device (GiB): {parts}; total {self.compiled_total / GIB:.2f} GiB",
            f"  planned per GPU: {self.planned.device_total / GIB:.2f} GiB ({self.planned_layout}) "
            f"-> compiled/planned {self.compiled_total / self.planned.device_total:.2f}",
            f"  state (parameters + optimizer): compiled {res['state_bytes'] / GIB:.3f} GiB, planned "
            f"{self.planned_state / GIB:.3f} GiB -> {res['state_bytes'] / self.planned_state:.3f}",
        ]
        if self.limit:
            lines.append("  " + self.limit.render(self.planned.device_total))
            if fit := self.limit.fit(self.compiled_total):
                lines.append("  " + fit)
        if host or self.planned.host_total:
            lines.append(
                f"  host (offloaded) per device: compiled {host / GIB:.2f} GiB, planned "
                f"{self.planned.host_total / GIB:.2f} GiB"
            )
        if self.exchange:
            lines.append("  " + self.exchange.render())
        if self.remat:
            lines.append("  " + self.remat.render())
        if self.traffic:
            lines.append("  " + self.traffic.render())
        if self.at_peak:
            lines += ["  " + line for line in self.at_peak.render(top=10).splitlines()]
        elif self.peak_note:
            lines.append("  " + self.peak_note)
        return "\n".join(lines)


def _dump_dir(r: ResolvedRecipe) -> Path | None:
    """Where the recipe's XLA flags ask XLA to dump the compiled HLO, if they do."""
    dump = _DUMP_TO.search(r.env.get("XLA_FLAGS", ""))
    return Path(dump.group(1)) if dump else None


def read_peak(r: ResolvedRecipe) -> tuple[peak.Peak | None, str]:
    """XLA's peak from the HLO dump the recipe's flags asked for, or (None, why not); (None, "") without one.
    The compile has succeeded by then, so an unreadable dump is a note, not an error."""
    dump = _dump_dir(r)
    if dump is None:
        return None, ""
    try:
        return peak.find_peak(dump), ""
    except UserError as e:
        return None, f"what is alive at XLA's peak: not read from {dump}: {e}"


def _from_dump[T](r: ResolvedRecipe, reader: Callable[[Path], T]) -> T | None:
    """What `reader` finds in the HLO dump the recipe's flags asked for (the step's all-to-alls and what XLA
    scheduled inside them; the GEMM work it recomputes; the bytes its memory-bound kernels move); None without a
    dump or with an unreadable one."""
    dump = _dump_dir(r)
    try:
        return reader(dump) if dump else None
    except UserError:
        return None


def run(ref: str, overrides: Sequence[str], r: ResolvedRecipe, *, gpus_here: int | None = None) -> CompiledPlan:
    """Compile `ref` with `overrides` (already resolved as `r`) and set it beside `r`'s analytical memory."""
    gpus = compile_route.local_gpus() if gpus_here is None else gpus_here
    route = compile_route.choose_route(r, gpus, deviceless_ok=not gpus and deviceless.available())
    compiled = validate.resolve(composition.compose(ref, [*overrides, *route.overrides]))
    lay = layout.from_recipe(r)
    result = compile_in_subprocess(compiled, route)
    at_peak, note = read_peak(compiled)
    hw = compiled.topology.profile
    # The budget is XLA:GPU's, from the allocator of the GPU it compiled for: the recipe's kind, or none to say.
    device_memory = deviceless.device_memory_bytes(hw)
    limit = (
        None
        if hw.maxtext_hardware != "gpu" or hw.name.upper() not in str(result.get("device_kind", "")).upper()
        else scheduler_limit.of(
            result["memory"],
            device_memory,
            result["xla_flags"],
            scheduler_limit.allocator_bytes(device_memory, result["allocator_env"]),
        )
    )
    planned = memory.per_gpu(Model.from_recipe(r), lay)
    return CompiledPlan(
        r.name,
        route,
        planned,
        lay.describe(),
        result,
        at_peak,
        note,
        limit,
        _from_dump(compiled, exchange_overlap.find),
        _from_dump(compiled, remat_gemms.find),
        _from_dump(compiled, memory_traffic.find),
    )
