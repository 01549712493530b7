"""`plan --compile` end to end: MaxText's real training step compiled in a subprocess on XLA:CPU devices,
its memory set beside the analytical plan. The state check ties the two: the step's state argument
(parameters, AdamW mu and nu, a step counter) must be what the planner counts as parameters plus
optimizer state on one device, so a wrong sharding or dtype on either side fails it."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

# The compiled arguments also hold the batch (token ids, positions, segments) and the optimizer's step
# count, which the planner's state leaves out: a few KiB on these layouts.
STATE_TOLERANCE = 0.02


def compile_json(*args: str) -> dict:
    r = run_cli("plan", *args, "--compile", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def check_state(data: dict) -> None:
    mem, planned = data["compiled"]["memory"], data["planned"]
    assert mem["argument_size"] > 0 and mem["temp_size"] > 0
    assert abs(mem["argument_size"] / planned["state_bytes"] - 1) < STATE_TOLERANCE
    assert abs(data["state_compiled_over_planned"] - 1) < STATE_TOLERANCE
    assert data["compiled_over_planned"] == pytest.approx(
        data["compiled"]["device_total_bytes"] / planned["memory_per_gpu_bytes"]
    )


@pytest.fixture(scope="module")
def four() -> dict:
    """The tiny recipe compiled for four CPU devices under FSDP, once for the tests that read it."""
    return compile_json("deepseek3-tiny-cpu", "topology.gpus_per_node=4", "ici_fsdp_parallelism=-1")


def test_tiny_recipe_on_four_cpu_devices_matches_the_planned_state(four: dict) -> None:
    data = four
    assert data["route"] == "cpu" and "bias against a GPU compile is unknown" in data["route_description"]
    res = data["compiled"]
    assert (res["devices"], res["platform"], res["mesh"]["fsdp"], res["partitioner"]) == (4, "cpu", 4, "shardy")
    assert data["planned"]["layout"].startswith("FSDP4 on 4 cpu")
    assert data["scheduler_limit"] is None  # XLA:CPU schedules to no memory budget
    check_state(data)


@pytest.mark.slow
def test_one_device_holds_four_times_the_fsdp4_state_and_text_names_the_route(four: dict) -> None:
    one = compile_json("deepseek3-tiny-cpu", "shardy=false")  # MaxText's own key: GSPMD, as its train sets it
    check_state(one)
    assert one["compiled"]["partitioner"] == "gspmd"
    assert one["compiled"]["state_bytes"] / four["compiled"]["state_bytes"] == pytest.approx(4, rel=0.01)
    r = run_cli("plan", "deepseek3-tiny-cpu", "--compile", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "XLA:CPU with 1 host devices" in r.stdout and "compiled/planned" in r.stdout


@pytest.mark.slow
def test_two_gpu_proxy_compiles_on_cpu_with_its_gpu_plan_beside_it() -> None:
    data = compile_json("deepseek3-proxy-h200-2gpu")
    assert data["route"] == "cpu" and "moe.gemm=ragged_dot" in data["compiled_with_overrides"]
    assert data["compiled"]["mesh"]["expert"] == 2
    assert data["planned"]["layout"].startswith("EP2 on 2 h200")
    check_state(data)


def test_compile_refuses_search_in_one_line() -> None:
    r = run_cli("plan", "deepseek3-tiny-cpu", "--compile", "--search")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--compile" in r.stderr


def test_a_long_compile_reports_its_progress_and_jax_phases() -> None:
    """A 671B compile runs for many minutes: a line every `every_s` seconds says how long, and which phase
    JAX last finished (from `jax_log_compiles` in the compile's log)."""
    from maxtext_moe.cli import resolve
    from maxtext_moe.plan import compile_route, compiled

    route = compile_route.choose_route(resolve("deepseek3-tiny-cpu", []), gpus_here=0)
    lines: list[str] = []
    result = compiled.compile_in_subprocess(
        resolve("deepseek3-tiny-cpu", list(route.overrides)), route, progress=lines.append, every_s=1.0
    )
    assert result["devices"] == 1 and lines, lines
    assert all(line.startswith("  compiling deepseek3-tiny-cpu: ") for line in lines)
    phases = [line.split("last finished: ")[1] for line in lines if "last finished: " in line]
    assert any(p.startswith(("tracing", "jaxpr to MLIR", "XLA compilation")) for p in phases), lines


def test_a_dump_without_a_buffer_assignment_gives_a_note_after_the_compile(tmp_path) -> None:
    """On the CPU route XLA writes no buffer assignment of MaxText's step: the compile's result stands and
    says why there is no peak (tests/gpu/test_plan_compile_gpu.py reads one from a GPU compile)."""
    dump = [f"xla_flags.xla_dump_to={tmp_path}", "xla_flags.xla_dump_hlo_as_text=true"]
    r = run_cli("plan", "deepseek3-tiny-cpu", *dump, "xla_flags.xla_dump_hlo_module_re=jit_train_step", "--compile")
    assert r.returncode == 0, r.stderr
    assert "compiled/planned" in r.stdout and "what is alive at XLA's peak: not read from" in r.stdout
    assert "no buffer assignment of 'jit_train_step'" in r.stdout


def test_a_compiler_crash_is_named_not_the_logs_last_line(tmp_path, monkeypatch) -> None:
    """XLA crashing in native code leaves a log that ends mid-phase; the error names the signal instead of
    quoting that last line. A stand-in interpreter kills itself with SIGSEGV, as XLA did (docs/UPSTREAM.md)."""
    from maxtext_moe.cli import resolve
    from maxtext_moe.errors import UserError
    from maxtext_moe.plan import compile_route, compiled

    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\necho 'WARNING: Finished jaxpr to MLIR module conversion'\nkill -SEGV $$\n")
    crash.chmod(0o755)
    monkeypatch.setattr(compiled.sys, "executable", str(crash))
    route = compile_route.choose_route(resolve("deepseek3-tiny-cpu", []), gpus_here=0)
    with pytest.raises(UserError) as e:
        compiled.compile_in_subprocess(resolve("deepseek3-tiny-cpu", list(route.overrides)), route, every_s=1.0)
    assert "died of SIGSEGV (XLA's compiler crashed" in str(e.value) and "WARNING" not in str(e.value)
