"""Rendered SLURM / Kubernetes jobs: the committed ones are current, and they match what `distributed` reads."""

from __future__ import annotations

import re
import subprocess
import time

import pytest
import yaml
from conftest import REPO, run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.errors import UserError
from maxtext_moe.run import distributed
from maxtext_moe.tools import launch

RECIPE = "deepseek3-671b-h200-128"


def _sbatch_directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, flags=re.M))


@pytest.mark.parametrize("committed", launch.COMMITTED, ids=lambda c: c.path)
def test_committed_scripts_are_what_launch_prints(committed):
    r = run_cli("launch", committed.recipe, f"--{committed.target}", "--nodes", str(committed.nodes), timeout=120)
    assert r.returncode == 0, r.stderr
    assert (REPO / committed.path).read_text() == r.stdout, (
        f"{committed.path} is stale: regenerate it with the command in its first lines"
    )


def test_slurm_job_one_task_per_gpu_matches_distributed_detection():
    text = launch.render(resolve(RECIPE, ["topology.nodes=16"]), "slurm")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    sb = _sbatch_directives(text)
    assert (sb["nodes"], sb["ntasks-per-node"], sb["gpus-per-node"]) == ("16", "8", "8")
    assert re.search(rf'^ARGS=\({RECIPE} topology\.nodes=16 base_output_directory=/runs "\$@"\)$', text, re.M)
    assert 'srun --kill-on-bad-exit=1 "${TASK[@]}" train "${ARGS[@]}" &' in text
    # What one of those 128 tasks sees under srun:
    env = {
        "SLURM_NTASKS": "128",
        "SLURM_NNODES": "16",
        "SLURM_PROCID": "9",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[003-018]",
    }
    spec = distributed.detect(env)
    assert (spec.source, spec.num_processes, spec.process_id, spec.local_device_ids) == ("slurm", 128, 9, (1,))
    assert spec.coordinator == f"gpu003:{4242 % 4096 + distributed.SLURM_PORT_BASE}"
    distributed.check_layout(spec, resolve(RECIPE, ["topology.nodes=16"]).topology)


def _k8s(recipe: str = RECIPE, *overrides: str) -> tuple[dict, dict]:
    return tuple(
        yaml.safe_load_all(launch.render(resolve(recipe, ["topology.nodes=16", *overrides]), "k8s", image="reg/mtm:1"))
    )


def test_k8s_indexed_job_and_headless_service_agree():
    service, job = _k8s()
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 16
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    container = pod["containers"][0]
    assert container["image"] == "reg/mtm:1" and container["command"] == ["/bin/bash", "-c"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e["value"] for e in container["env"]}
    name, port = job["metadata"]["name"], service["spec"]["ports"][0]["port"]
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-0.{name}:{port}" and env["JAX_NUM_PROCESSES"] == "128"
    # Process 1 of pod 3, as the pod script starts it: one process per GPU.
    detected = distributed.detect(
        env | {"JOB_COMPLETION_INDEX": "3", "JAX_PROCESS_ID": "25", "JAX_LOCAL_DEVICE_IDS": "1"}
    )
    assert (detected.num_processes, detected.process_id, detected.local_device_ids) == (128, 25, (1,))
    distributed.check_layout(detected, resolve(RECIPE, ["topology.nodes=16"]).topology)


# A SIGTERM: the stand-in "saves" (SAVE_S seconds on odd process ids, none on even ones) and exits 143, as
# `maxtext-moe train` does after the checkpoint; FAIL_ON_TERM makes that process fail instead. FAIL_ID fails
# that process (status FAIL_STATUS, else 3) in every attempt, or only in attempts below FAIL_ATTEMPTS; the others
# wait for a peer that is gone.
STAND_IN = """#!/bin/bash
if [ "$1" = report ]; then echo "$MAXTEXT_MOE_ATTEMPT $*" >> "$OUT/report"; exit 0; fi
on_term() {
  [ "$JAX_PROCESS_ID" = "${FAIL_ON_TERM:-}" ] && exit 5
  [ $((JAX_PROCESS_ID % 2)) = 1 ] && sleep "${SAVE_S:-0}"
  echo term > "$OUT/term-$JAX_PROCESS_ID"; exit 143
}
[ -n "${TERM_TEST:-}" ] && trap on_term TERM
echo "$JAX_PROCESS_ID ${JAX_LOCAL_DEVICE_IDS-none} $*" > "$OUT/$JAX_PROCESS_ID"
echo "$MAXTEXT_MOE_ATTEMPT" >> "$OUT/attempts-$JAX_PROCESS_ID"
if [ -n "${TERM_TEST:-}" ]; then sleep 60 & wait; exit 1; fi
if [ -n "${FAIL_ID:-}" ] && [ "$MAXTEXT_MOE_ATTEMPT" -lt "${FAIL_ATTEMPTS:-99}" ]; then
  [ "$JAX_PROCESS_ID" = "$FAIL_ID" ] && exit "${FAIL_STATUS:-3}"
  exec sleep 60
fi
exit 0
"""


def _pod(tmp_path, job: dict, index: int, **env: str) -> subprocess.Popen:
    """The pod's script under bash, `maxtext-moe` replaced by a stand-in that records what it was given."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    (bin_dir / "maxtext-moe").write_text(STAND_IN)
    (bin_dir / "maxtext-moe").chmod(0o755)
    container = job["spec"]["template"]["spec"]["containers"][0]
    return subprocess.Popen(
        [*container["command"], container["args"][0]],
        text=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(out), "JOB_COMPLETION_INDEX": str(index), **env},
    )


def _run_pod(tmp_path, job: dict, index: int, **env: str) -> subprocess.CompletedProcess:
    proc = _pod(tmp_path, job, index, **env)
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=30))


def test_k8s_pod_starts_one_process_per_gpu(tmp_path):
    r = _run_pod(tmp_path, _k8s()[1], 3)
    assert r.returncode == 0, r.stderr
    seen = sorted((tmp_path / "out" / str(i)).read_text().split(maxsplit=2) for i in range(24, 32))
    assert [(p, d) for p, d, _ in seen] == [(str(24 + j), str(j)) for j in range(8)]
    assert {a.strip() for _, _, a in seen} == {f"train {RECIPE} topology.nodes=16 base_output_directory=/runs"}
    assert sorted(p.name for p in (tmp_path / "out").glob("[0-9]*")) == [str(i) for i in range(24, 32)]


def _attempts(tmp_path, process: int) -> list[int]:
    return [int(a) for a in (tmp_path / "out" / f"attempts-{process}").read_text().split()]


def test_k8s_pod_stops_the_others_when_one_process_fails_and_starts_them_again_up_to_max_restarts(tmp_path):
    """Process 5 fails in every attempt: each time the pod ends the others at once (they wait for a peer that is
    gone), pod 0 prints what ended the attempt, and the pod starts all eight again, 3 times (job.max_restarts);
    then it fails with that status, which fails the Job."""
    start = time.monotonic()
    r = _run_pod(tmp_path, _k8s()[1], 0, FAIL_ID="5")
    assert r.returncode == 3 and time.monotonic() - start < 30  # the others sleep 60 s unless killed
    assert _attempts(tmp_path, 5) == [0, 1, 2, 3]
    # The others may be killed before they record an attempt (process 5 can fail first): none ran a fifth.
    assert all(
        set(_attempts(tmp_path, p)) <= {0, 1, 2, 3} for p in range(8) if (tmp_path / "out" / f"attempts-{p}").exists()
    )
    reports = (tmp_path / "out" / "report").read_text().splitlines()
    assert reports == [f"{a} report {RECIPE} topology.nodes=16 base_output_directory=/runs" for a in range(4)]


def test_k8s_pod_goes_on_after_a_failure_that_a_restart_mends(tmp_path):
    """Process 17 (pod 2) fails in the first attempt only: the pod's second attempt trains to the end. Pods other
    than pod 0 leave the report to it."""
    r = _run_pod(tmp_path, _k8s("deepseek3-671b-h200-128", "job.max_restarts=1")[1], 2, FAIL_ID="17", FAIL_ATTEMPTS="1")
    assert r.returncode == 0
    assert _attempts(tmp_path, 17) == [0, 1]
    assert all(_attempts(tmp_path, p)[-1] == 1 for p in range(16, 24))  # a killed one may not have recorded attempt 0
    assert not (tmp_path / "out" / "report").exists()


def test_k8s_pod_does_not_restart_an_error_in_the_recipe_data_or_run_folder(tmp_path):
    """maxtext-moe's status 2: every restart would end on the same error."""
    r = _run_pod(tmp_path, _k8s()[1], 0, FAIL_ID="5", FAIL_STATUS="2")
    assert r.returncode == 2 and _attempts(tmp_path, 5) == [0]
    assert not (tmp_path / "out" / "report").exists()


def test_k8s_pod_with_no_restarts_fails_at_the_first_failure(tmp_path):
    job = yaml.safe_load_all(
        launch.render(resolve(RECIPE, ["topology.nodes=16"]), "k8s", image="reg/mtm:1", max_restarts=0)
    )
    r = _run_pod(tmp_path, list(job)[1], 0, FAIL_ID="5")
    assert r.returncode == 3 and _attempts(tmp_path, 5) == [0]


def _terminate_pod(tmp_path, **env: str) -> int:
    """Start pod 1 (processes 8-15) with the SIGTERM-aware stand-in, SIGTERM it once all run, return its status."""
    proc = _pod(tmp_path, _k8s()[1], 1, TERM_TEST="1", **env)
    deadline = time.monotonic() + 20
    while len(list((tmp_path / "out").glob("[0-9]*"))) < 8 and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.terminate()
    return proc.wait(timeout=30)


def test_k8s_pod_passes_sigterm_to_every_process_and_lets_each_finish_its_save(tmp_path):
    """Pod deletion or preemption: every process gets the SIGTERM, saves and exits 143. The even ones stop at
    once; the odd ones are still saving then and must not be killed: the pod ends 143, a stop the Job ignores."""
    assert _terminate_pod(tmp_path, SAVE_S="3") == 143
    assert sorted(p.name for p in (tmp_path / "out").glob("term-*")) == sorted(f"term-{i}" for i in range(8, 16))


def test_k8s_pod_reports_a_failure_during_a_stop_not_the_stop(tmp_path):
    """A process that fails while the others stop: the pod exits with the failure, which the Job counts."""
    assert _terminate_pod(tmp_path, FAIL_ON_TERM="12") == 5


def test_k8s_job_fails_whole_on_a_failure_and_replaces_every_pod_after_a_stop():
    _, job = _k8s()
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    # Any failure fails the Job, which stops every other pod: a plain Job cannot restart the pods together.
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    # 143 (a checkpoint saved on a SIGTERM) is not counted: the pod is replaced, once the old one has ended.
    assert spec["podFailurePolicy"]["rules"] == [
        {"action": "Ignore", "onExitCodes": {"containerName": "train", "operator": "In", "values": [143]}}
    ]
    assert spec["podReplacementPolicy"] == "Failed"


def test_k8s_grace_period_and_slurm_warning_hold_a_step_and_a_checkpoint_save_of_the_671b_recipe():
    """The figures in the template's comment: weights and Adam moments by the planner, written at 2.4 GB/s."""
    from maxtext_moe import plan

    estimate = plan.estimate(resolve(RECIPE, ["topology.nodes=16"])).to_json()
    per_process_gib = sum(v for k, v in estimate["memory_breakdown_gib"].items() if k.startswith(("param", "optim")))
    saved_bytes = per_process_gib * 2**30 * 128
    assert round(per_process_gib) == 30 and round(saved_bytes / 2**40, 1) == 3.7
    need_s = estimate["step_time_s"] + saved_bytes / 2.4e9
    assert need_s < _k8s()[1]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == launch.STOP_S
    slurm = launch.render(resolve(RECIPE, ["topology.nodes=16"]), "slurm")
    assert _sbatch_directives(slurm)["signal"] == f"B:USR1@{launch.STOP_S}"


def test_k8s_cpu_recipe_runs_one_process_per_pod_with_launchs_overrides(tmp_path):
    """The recipe overrides given to `launch` reach every process, as they do under SLURM."""
    overrides = ["ici_fsdp_parallelism=-1", "steps=7"]
    text = launch.render(resolve("deepseek3-tiny-cpu", ["topology.nodes=16", *overrides]), "k8s", overrides=overrides)
    job = list(yaml.safe_load_all(text))[1]
    env = {e["name"]: e["value"] for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["JAX_NUM_PROCESSES"] == "16"
    assert _run_pod(tmp_path, job, 2).returncode == 0
    process, devices, args = (tmp_path / "out" / "2").read_text().split(maxsplit=2)
    assert (process, devices) == ("2", "none")  # every CPU device: no device ids
    assert args.split()[-2:] == overrides


def test_cpu_recipe_renders_one_process_per_node_without_gpus():
    text = launch.render(resolve("deepseek3-tiny-cpu", ["topology.nodes=2", "ici_fsdp_parallelism=-1"]), "slurm")
    sb = _sbatch_directives(text)
    assert sb["ntasks-per-node"] == "1" and "gpus-per-node" not in sb


def test_launch_refuses_a_layout_the_planner_says_does_not_fit():
    r = run_cli("launch", RECIPE, "--slurm", "--nodes", "4", timeout=120)
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "topology.nodes" in r.stderr and "--search" in r.stderr
    assert r.stdout == ""


def test_launch_accepts_the_measured_proxy_and_refuses_a_batch_that_does_not_fit_unless_asked():
    """The one-GPU proxy ran at 110.9 GiB on an H200 (docs/PERFORMANCE.md): accepted. Batch 12 plans well above
    the usable memory: refused by default, with the way out named; printed with --skip-fit-check."""
    r = run_cli("launch", "deepseek3-proxy-h200-1gpu", "--slurm", "--nodes", "1", timeout=120)
    assert r.returncode == 0, r.stderr
    assert _sbatch_directives(r.stdout)["gpus-per-node"] == "1"
    big = ("deepseek3-proxy-h200-1gpu", "--slurm", "--nodes", "1", "per_device_batch_size=12")
    refused = run_cli("launch", *big, timeout=120)
    assert refused.returncode == 2 and "--skip-fit-check" in refused.stderr
    assert run_cli("launch", *big, "--skip-fit-check", timeout=120).returncode == 0


def test_the_h100_recipe_is_refused_by_the_plan_it_compiles_under_and_names_the_compile_to_check():
    """As shipped, `deepseek3-671b-h100-256` compiles to 65.8 of 69.6 GiB (docs/results), where the plan says 72.1:
    `launch` refuses it, naming `plan --compile` and --skip-fit-check, and prints the job with the flag."""
    args = ("deepseek3-671b-h100-256", "--slurm", "--nodes", "32")
    refused = run_cli("launch", *args, timeout=120)
    assert refused.returncode == 2
    assert (
        "maxtext-moe plan deepseek3-671b-h100-256 --compile" in refused.stderr and "--skip-fit-check" in refused.stderr
    )
    assert run_cli("launch", *args, "--skip-fit-check", timeout=120).returncode == 0


def test_layout_mismatch_and_incomplete_env_are_user_errors():
    topo = resolve(RECIPE, ["topology.nodes=16"]).topology
    with pytest.raises(UserError, match="topology.nodes"):
        distributed.check_layout(distributed.ProcessSpec("env", 3, 0, "h:1", None), topo)
    with pytest.raises(UserError, match="JAX_COORDINATOR_ADDRESS"):
        distributed.detect({"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"})
    assert distributed.detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == distributed.SINGLE


@pytest.mark.parametrize(
    "nodelist,host",
    [("gpu[007-009,012],cpu1", "gpu007"), ("node17", "node17"), ("a-b[01-02]", "a-b01"), ("n1,n2", "n1")],
)
def test_first_slurm_host(nodelist, host):
    assert distributed.first_slurm_host(nodelist) == host


def test_one_process_for_several_gpus_with_expert_parallelism_is_warned_about():
    """Accepted (it may work elsewhere) but said up front: on two H200s that layout hung."""
    two = resolve("deepseek3-proxy-h200-2gpu", []).topology
    env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}
    one_for_both = distributed.detect(env)
    per_gpu = distributed.detect(env | {"JAX_NUM_PROCESSES": "2", "JAX_LOCAL_DEVICE_IDS": "1"})
    assert "hung in its first all-gather" in distributed.layout_warning(one_for_both, two, expert_parallel=True)
    assert distributed.layout_warning(per_gpu, two, expert_parallel=True) is None
    assert distributed.layout_warning(one_for_both, two, expert_parallel=False) is None
    assert (
        distributed.layout_warning(distributed.SINGLE, resolve("deepseek3-proxy-h200-1gpu", []).topology, True) is None
    )
    cpu = resolve("deepseek3-tiny-cpu", ["topology.gpus_per_node=2", "ici_expert_parallelism=-1"]).topology
    assert distributed.layout_warning(distributed.SINGLE, cpu, expert_parallel=True) is None
