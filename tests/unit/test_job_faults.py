"""The job section, the watchdog's verdict and the report line, on records as processes write them."""

from __future__ import annotations

import time

import pytest
from conftest import run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import job
from maxtext_moe.run import job_report, watchdog


def test_job_section_defaults_and_timeouts():
    settings = resolve("deepseek3-tiny-cpu", []).job_settings
    assert (settings.max_restarts, settings.watchdog, settings.compile_cache) == (3, "auto", "auto")
    assert settings.timeout(None) == settings.first_step_s  # before the first step: the compilation floor
    assert settings.timeout(0.5) == job.AUTO_MIN_S
    assert settings.timeout(60.0) == 60.0 * job.AUTO_FACTOR
    fixed = resolve("deepseek3-tiny-cpu", ["job.watchdog=30", "job.first_step_s=10"]).job_settings
    assert (fixed.timeout(None), fixed.timeout(100.0)) == (30.0, 30.0)
    assert resolve("deepseek3-tiny-cpu", ["job.watchdog=off"]).job_settings.timeout(1.0) is None
    assert job.cache_dir(settings, "/r/x", 4, False, "~/jax_cache") == "/r/x/jax_cache"
    assert job.cache_dir(settings, "/r/x", 4, True, "~/jax_cache") == ""  # only process 0 would hit it on CPUs
    assert job.cache_dir(settings, "/r/x", 1, True, "~/jax_cache") == "~/jax_cache"
    off = resolve("deepseek3-tiny-cpu", ["job.compile_cache=off"]).job_settings
    assert job.cache_dir(off, "/r/x", 1, True, "~/jax_cache") == ""


@pytest.mark.parametrize(
    "override, message",
    [
        ("job.max_restarts=-1", "job.max_restarts: must be a whole number of at least 0"),
        ("job.watchdog=0", "job.watchdog: must be a number of seconds above 0"),
        ("job.first_step_s=-5", "job.first_step_s: must be a number of seconds above 0"),
        ("job.restarts=2", "job.restarts: unknown job field"),
    ],
)
def test_bad_job_values_name_the_key(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        resolve("deepseek3-tiny-cpu", [override])


@pytest.mark.parametrize(
    "args, message",
    [
        (["deepseek3-671b-h200-128", "--nodes", "16", "job.watchdog=5"], "job.watchdog: is 5 s, but the planner puts"),
        (["deepseek3-671b-h200-128", "--nodes", "16", "--max-restarts", "-1"], "--max-restarts: must be 0 or more"),
        (["deepseek3-tiny-cpu", "--nodes", "3", "ici_fsdp_parallelism=2"], "does not fit 3 devices"),
        (["deepseek3-671b-h200-128", "--nodes", "16", "--tasks-per-node", "2"], "--tasks-per-node: is for CPU"),
        (["deepseek3-671b-h200-128", "--nodes", "16", "--k8s", "--runtime", "venv"], "--k8s: --runtime and --venv"),
    ],
)
def test_launch_refuses_bad_job_options_in_one_line(args, message):
    target = [] if "--k8s" in args else ["--slurm"]
    r = run_cli("launch", *target, *args, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr
    assert r.stdout == ""


def _record(process: int, step: int | None, age: float, now: float, launch: str = "") -> watchdog.Record:
    return watchdog.Record(
        process, f"n{process // 2 + 1}", 100 + process, 0, step, now - age - 1, now - age, launch=launch
    )


def test_the_silent_process_is_the_stale_one_else_the_one_behind():
    now = time.time()
    stopped = [_record(0, 7, 0.5, now), _record(1, 7, 40.0, now), _record(2, 7, 1.0, now)]
    who, why = watchdog.silent(stopped, now)
    assert who.process == 1 and why.startswith("no heartbeat for 40 s")
    behind = [_record(0, 9, 0.5, now), _record(1, 9, 0.5, now), _record(3, 8, 0.5, now)]
    who, why = watchdog.silent(behind, now)
    assert who.process == 3 and "is still before step 9" in why
    who, why = watchdog.silent([_record(0, 9, 0.5, now), _record(1, 9, 0.5, now)], now)
    assert who is None and "every process is alive at step 9" in why


def test_fault_injection_reads_its_variable(monkeypatch):
    monkeypatch.setenv(watchdog.FAULT_VAR, "hang:process=3:step=9:attempt=2")
    assert watchdog._fault(3, 2) == 9
    assert watchdog._fault(3, 1) is None and watchdog._fault(2, 2) is None
    monkeypatch.setenv(watchdog.FAULT_VAR, "hang:rank=3")
    with pytest.raises(UserError, match="MAXTEXT_MOE_FAULT"):
        watchdog._fault(3, 0)


LAUNCH = "7/-/1"  # job 7, never requeued, attempt 1


def _heartbeats(run, now: float, launch: str, processes: int = 4, verdict: dict[int, float] | None = None) -> None:
    """Every process at step 5; `verdict` maps a process to the time its watchdog fired."""
    for p in range(processes):
        r = _record(p, 5, 1.0, now, launch)
        if p in (verdict or {}):
            r.updated, r.verdict = verdict[p], f"maxtext-moe: watchdog: process {p} on n1 has made no progress."
        watchdog.write_json(watchdog.record_path(run, p), vars(r))


def _exits(run, now: float, launch: str, exits: dict[int, tuple[int, str]]) -> None:
    """Each supervisor's record: process -> (status, who ended it); process p ended at now + p."""
    for p, (status, by) in exits.items():
        how = "killed by SIGKILL" if status == -9 else f"exited with status {status}"
        watchdog.write_json(
            run / "processes" / f"exit-{p}.json",
            {"process": p, "host": f"n{p // 2 + 1}", "pid": 100 + p, "status": status, "how": how, "by": by,
             "signals": [], "time": now + p, "launch": launch},
        )  # fmt: skip


def _report(run, monkeypatch, launch: str = LAUNCH) -> tuple[str, bool]:
    """`report` as the job script's shell runs it, with its launcher's variables."""
    for var, value in zip(watchdog.LAUNCH_VARS, launch.split("/"), strict=True):
        monkeypatch.setenv(var, value) if value != "-" else monkeypatch.delenv(var, raising=False)
    return job_report.line(run)


def _line(run, monkeypatch, launch: str = LAUNCH) -> str:
    return _report(run, monkeypatch, launch)[0]


def test_report_names_the_process_that_ended_by_itself(tmp_path, monkeypatch):
    now = time.time()
    _heartbeats(tmp_path, now, LAUNCH)
    _exits(tmp_path, now, LAUNCH, {0: (143, "launcher"), 1: (143, "launcher"), 2: (-9, "itself"), 3: (-15, "launcher")})
    line = _line(tmp_path, monkeypatch)
    assert line.startswith("maxtext-moe: lost: process 2 on n2 (pid 102) killed by SIGKILL in step 5;")
    assert "no complete checkpoint yet" in line
    (tmp_path / "processes" / "exit-2.json").unlink()  # its node went away with its supervisor
    _exits(tmp_path, now, LAUNCH, {0: (143, "launcher"), 1: (143, "launcher"), 3: (-15, "launcher")})
    assert "lost: process 2 on n2 (pid 102) left no exit record" in _line(tmp_path, monkeypatch)


@pytest.mark.parametrize(("verdict_at", "named"), [(-5.0, "hung: watchdog: process 1"), (5.0, "lost: process 2")])
def test_report_names_whichever_went_wrong_first_a_verdict_or_a_process_ending_by_itself(
    tmp_path, monkeypatch, verdict_at, named
):
    """A process that dies of its own error makes the others' collectives stall, and their watchdogs may fire
    after it: the report names the first event, not the loudest."""
    now = time.time()
    _heartbeats(tmp_path, now, LAUNCH, verdict={1: now + verdict_at})
    _exits(tmp_path, now, LAUNCH, {0: (143, "launcher"), 1: (3, "itself"), 2: (1, "itself"), 3: (143, "launcher")})
    assert _line(tmp_path, monkeypatch).startswith(f"maxtext-moe: {named}")


def test_report_says_a_restart_would_repeat_an_error_in_the_recipe_data_or_run_folder(tmp_path, monkeypatch):
    """Process 0 refused the run folder (status 2, an error every restart meets again) before the others were
    stopped: the job script is told not to restart. A crash of its own (status 1) is worth a restart."""
    now = time.time()
    _heartbeats(tmp_path, now, LAUNCH)
    _exits(tmp_path, now, LAUNCH, {0: (2, "itself"), 1: (2, "itself"), 2: (143, "launcher"), 3: (143, "launcher")})
    line, repeats = _report(tmp_path, monkeypatch)
    assert repeats and line.startswith("maxtext-moe: lost: process 0 on n1 (pid 100) exited with status 2 in step 5")
    assert "A restart would end the same way" in line
    _exits(tmp_path, now, LAUNCH, {0: (1, "itself")})
    assert _report(tmp_path, monkeypatch) == (_line(tmp_path, monkeypatch), False)


def test_report_reads_only_this_launchs_records(tmp_path, monkeypatch):
    """A run folder resumed by a job of two processes still holds the records of the job of four before it, whose
    process 3 was killed: the new job's report is about its own processes only."""
    now = time.time()
    before = "6/-/0"
    _heartbeats(tmp_path, now - 600, before)
    _exits(
        tmp_path,
        now - 600,
        before,
        {0: (143, "launcher"), 1: (143, "launcher"), 2: (143, "launcher"), 3: (-9, "itself")},
    )
    assert "lost: process 3" in _line(tmp_path, monkeypatch, before)
    _heartbeats(tmp_path, now, LAUNCH, processes=2)
    _exits(tmp_path, now, LAUNCH, {0: (143, "launcher"), 1: (143, "launcher")})
    assert _line(tmp_path, monkeypatch).startswith("maxtext-moe: stopped: every process saved a checkpoint")
    _exits(tmp_path, now, LAUNCH, {0: (0, "itself"), 1: (0, "itself")})
    assert _line(tmp_path, monkeypatch).startswith("maxtext-moe: finished;")


def test_the_step_hook_and_the_heartbeat_thread_write_one_record_without_tripping_on_each_other(tmp_path):
    """Both write process-K.json from one process; with one temporary name for both, a rename took the other's
    file away and the trainer died of FileNotFoundError in the middle of a job."""
    import threading

    from maxtext_moe.recipe.job import JobSettings

    dog = watchdog.Watchdog(tmp_path, 2, JobSettings())
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(300):
                dog._write()
        except BaseException as e:  # noqa: BLE001 - the test reports any of them
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(2)]
    for t in threads:
        t.start()
    for step in range(300):
        dog.before_step(step)
    for t in threads:
        t.join()
    assert errors == []
    assert watchdog.read_records(tmp_path, watchdog.launch_id())[0].step == 299


def test_a_sigterm_writes_this_processs_stacks_and_a_clean_exit_leaves_no_file(tmp_path):
    """The launcher ends an attempt with SIGTERM to every process: each writes its stacks, then the signal goes
    on to the handler that was there before (JAX's preemption notifier in a job)."""
    import signal

    from maxtext_moe.recipe.job import JobSettings

    seen: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with watchdog.Watchdog(tmp_path, 1, JobSettings()):
            pass
        assert not (tmp_path / "stacks").exists()
        with watchdog.Watchdog(tmp_path, 1, JobSettings()):
            signal.raise_signal(signal.SIGTERM)
        stacks = (tmp_path / "stacks" / "process-1.txt").read_text()
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [signal.SIGTERM]
    assert stacks.startswith("== process 1 on ") and "most recent call first" in stacks
    assert "test_a_sigterm_writes_this_processs_stacks" in stacks


def test_a_process_stopped_by_process_0s_failure_gives_its_fix_once(monkeypatch):
    """The other processes repeat process 0's message; with a fix of its own it read "... Fix: ... Fix: see
    process 0's message"."""
    from maxtext_moe.run import distributed
    from maxtext_moe.upstream import jax_coordination

    told = "failed: run folder: in use by another run. Fix: wait for it."

    class Store:
        def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
            return told

    monkeypatch.setattr(jax_coordination, "client", Store)
    spec = distributed.ProcessSpec("slurm", 2, 1, "h:1", None)
    with pytest.raises(UserError) as e, distributed.leader_first(spec, "run folder"):
        pass
    assert str(e.value).count("Fix:") == 1 and str(e.value).endswith("Fix: wait for it.")


def test_a_coordinator_port_is_not_one_the_kernel_gives_outgoing_connections(tmp_path, monkeypatch):
    """A coordinator binds its port seconds after it is chosen, in another process: a port from the kernel's
    ephemeral range may meanwhile go to any outgoing connection, so it comes from the gap above that range and
    below JAX's SLURM ports; with no port of the gap free, the kernel's choice."""
    import socket

    from maxtext_moe.run import distributed

    low, high = map(int, distributed.EPHEMERAL_RANGE.read_text().split())
    if high + 1 >= distributed.SLURM_PORT_BASE:
        pytest.skip(f"this machine's ephemeral ports ({low}-{high}) leave no gap below JAX's SLURM ports")
    assert all(high < distributed.free_port() < distributed.SLURM_PORT_BASE for _ in range(20))

    last = distributed.SLURM_PORT_BASE - 1
    narrow = tmp_path / "ip_local_port_range"
    narrow.write_text(f"{low} {last - 1}\n")  # a gap of one port, held below
    monkeypatch.setattr(distributed, "EPHEMERAL_RANGE", narrow)
    with socket.socket() as held:
        held.bind(("127.0.0.1", last))
        port = distributed.free_port()
    assert port != last and low <= port <= high
