"""`plan --compile` on a GPU: the mock-topology route compiles a sharded step with TE's FP8 dense GEMMs.

MaxText's AOT tool compiles outside TE's global MeshResource, and XLA's partitioner then stopped in TE's
amax all-reduce ("Global mesh resource is not set") on every 671B recipe (H200, 2026-12-01)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import REPO


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
def test_sharded_compile_with_te_fp8_dense_gemms() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    r = subprocess.run(
        [sys.executable, "-m", "maxtext_moe", "plan", "deepseek3-proxy-h200-2gpu", "quantization=te_fp8_currentscaling"]
        + ["--compile", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["route"] == "gpu" and result["compiled"]["devices"] == 2
    assert 0.5 < result["state_compiled_over_planned"] < 1.5
