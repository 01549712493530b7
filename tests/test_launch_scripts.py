"""Rendered SLURM / Kubernetes jobs: the committed ones are current, and they match what `distributed` reads."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from conftest import REPO, run_cli
from maxtext_moe import cluster, distributed
from maxtext_moe.cli import resolve
from maxtext_moe.errors import UserError

RECIPE = "deepseek3-671b-h200-128"


def _sbatch_directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, flags=re.M))


@pytest.mark.parametrize("committed", cluster.COMMITTED, ids=lambda c: c.path)
def test_committed_scripts_are_what_launch_prints(committed):
    r = run_cli("launch", committed.recipe, f"--{committed.target}", "--nodes", str(committed.nodes), timeout=120)
    assert r.returncode == 0, r.stderr
    assert (REPO / committed.path).read_text() == r.stdout, (
        f"{committed.path} is stale: regenerate it with the command in its first lines")


def test_slurm_job_one_task_per_gpu_matches_distributed_detection():
    text = cluster.render(resolve(RECIPE, ["topology.nodes=16"]), "slurm")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    sb = _sbatch_directives(text)
    assert (sb["nodes"], sb["ntasks-per-node"], sb["gpus-per-node"]) == ("16", "8", "8")
    assert re.search(rf"^\s*maxtext-moe train {RECIPE} topology\.nodes=16 base_output_directory=/runs \"\$@\"$", text, re.M)
    # What one of those 128 tasks sees under srun:
    env = {"SLURM_NTASKS": "128", "SLURM_NNODES": "16", "SLURM_PROCID": "9", "SLURM_LOCALID": "1",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[003-018]"}
    spec = distributed.detect(env)
    assert (spec.source, spec.num_processes, spec.process_id, spec.local_device_ids) == ("slurm", 128, 9, (1,))
    assert spec.coordinator == f"gpu003:{4242 % 4096 + distributed.SLURM_PORT_BASE}"
    distributed.check_layout(spec, resolve(RECIPE, ["topology.nodes=16"]).topology)


def test_k8s_indexed_job_and_headless_service_agree():
    docs = list(yaml.safe_load_all(cluster.render(resolve(RECIPE, ["topology.nodes=16"]), "k8s", image="reg/mtm:1")))
    service, job = docs
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 16
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    container = pod["containers"][0]
    assert container["image"] == "reg/mtm:1"
    assert container["args"][:3] == ["train", RECIPE, "topology.nodes=16"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    env = {e["name"]: e["value"] for e in container["env"]}
    name, port = job["metadata"]["name"], service["spec"]["ports"][0]["port"]
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{name}-0.{name}:{port}"
    # Pod 3 of the indexed Job, with the manifest's env: one process per node, all its GPUs.
    detected = distributed.detect(env | {"JOB_COMPLETION_INDEX": "3"})
    assert (detected.source, detected.num_processes, detected.process_id, detected.local_device_ids) == (
        "kubernetes", 16, 3, None)
    distributed.check_layout(detected, resolve(RECIPE, ["topology.nodes=16"]).topology)


def test_cpu_recipe_renders_one_process_per_node_without_gpus():
    text = cluster.render(resolve("deepseek3-tiny-cpu", ["topology.nodes=2", "ici_fsdp_parallelism=-1"]), "slurm")
    sb = _sbatch_directives(text)
    assert sb["ntasks-per-node"] == "1" and "gpus-per-node" not in sb


def test_launch_refuses_a_layout_the_planner_says_does_not_fit():
    r = run_cli("launch", RECIPE, "--slurm", "--nodes", "4", timeout=120)
    assert r.returncode == 2
    assert "does not fit" in r.stderr and "topology.nodes" in r.stderr and "--search" in r.stderr
    assert r.stdout == ""


def test_layout_mismatch_and_incomplete_env_are_user_errors():
    topo = resolve(RECIPE, ["topology.nodes=16"]).topology
    with pytest.raises(UserError, match="topology.nodes"):
        distributed.check_layout(distributed.ProcessSpec("env", 3, 0, "h:1", None), topo)
    with pytest.raises(UserError, match="JAX_COORDINATOR_ADDRESS"):
        distributed.detect({"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"})
    assert distributed.detect({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == distributed.SINGLE


@pytest.mark.parametrize("nodelist,host", [("gpu[007-009,012],cpu1", "gpu007"), ("node17", "node17"),
                                           ("a-b[01-02]", "a-b01"), ("n1,n2", "n1")])
def test_first_slurm_host(nodelist, host):
    assert distributed.first_slurm_host(nodelist) == host
