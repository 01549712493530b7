"""The rendered Kubernetes Service and Job against Kubernetes' own OpenAPI schemas, release by release.

kubernetes-validate (pinned in the test extra) ships the JSON schemas of each Kubernetes release inside the
package, so this runs offline. Strict mode refuses any field a release does not know, which catches a
misspelt key or a field newer than the cluster. 1.29 is the oldest release checked: podReplacementPolicy
is on by default from it, and the older schemas require onPodConditions in every podFailurePolicy rule.
Rules the API server applies beyond the schema (which fields go together) are asserted below.
"""

from __future__ import annotations

import importlib.resources
import re

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils

from maxtext_moe.cli import resolve
from maxtext_moe.tools import launch

OLDEST = (1, 29)
VERSIONS = sorted(
    {utils.major_minor(v) for v in utils.all_versions() if tuple(map(int, utils.major_minor(v).split("."))) >= OLDEST},
    key=lambda v: tuple(map(int, v.split("."))),
)
RENDERS = {
    "gpu-16-nodes": ("deepseek3-671b-h200-128", 16, []),
    "cpu-2-nodes": ("deepseek3-tiny-cpu", 2, ["ici_fsdp_parallelism=-1"]),
}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _render(key: str) -> list[dict]:
    recipe, nodes, overrides = RENDERS[key]
    text = launch.render(resolve(recipe, [f"topology.nodes={nodes}", *overrides]), "k8s", image="reg/mtm:1")
    return list(yaml.safe_load_all(text))


def test_k8s_schemas_cover_129_to_137_and_ship_inside_the_package():
    """No network: every schema is a file of the installed package."""
    assert VERSIONS[0] == "1.29" and "1.37" in VERSIONS, VERSIONS
    schemas = importlib.resources.files(kubernetes_validate) / "kubernetes-json-schema"
    for version in VERSIONS:
        folder = schemas / f"v{version}.0-local-strict"
        assert (folder / "job-batch-v1.json").is_file() and (folder / "service-v1.json").is_file(), folder


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("key", RENDERS)
def test_k8s_service_and_job_are_valid_for_the_release(key, version):
    docs = _render(key)
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    for doc in docs:
        assert kubernetes_validate.validate(doc, version, strict=True) == version


def test_k8s_strict_validation_refuses_a_misspelt_field():
    job = _render("cpu-2-nodes")[1]
    job["spec"]["template"]["spec"]["terminationGracePeriod"] = 60
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(job, VERSIONS[-1], strict=True)


@pytest.mark.parametrize("key", RENDERS)
def test_k8s_job_meets_the_api_server_rules_beyond_the_schema(key):
    service, job = _render(key)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    name = job["metadata"]["name"]
    # Pod hostnames are '<job>-<index>' and the Service name is a DNS label: 63 characters at most.
    nodes = spec["completions"]
    assert DNS_LABEL.fullmatch(name) and len(f"{name}-{nodes - 1}") <= 63
    assert DNS_LABEL.fullmatch(service["metadata"]["name"]) and pod["subdomain"] == service["metadata"]["name"]
    # podFailurePolicy needs restartPolicy Never and, with it, Failed is the only replacement policy allowed.
    assert pod["restartPolicy"] == "Never" and spec["podReplacementPolicy"] == "Failed"
    containers = {c["name"] for c in pod["containers"]}
    for rule in spec["podFailurePolicy"]["rules"]:
        assert rule["action"] in {"FailJob", "FailIndex", "Ignore", "Count"}
        codes = rule["onExitCodes"]
        assert codes["containerName"] in containers and codes["operator"] in {"In", "NotIn"}
        assert 0 not in codes["values"] and codes["values"] == sorted(set(codes["values"]))
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == nodes
