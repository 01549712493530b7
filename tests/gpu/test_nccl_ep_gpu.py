"""`moe.exchange: nccl_ep` on two GPUs, one process each (NCCL EP's layout): outputs and gradients of our EP
layer through TE's NCCL EP against the same layer through XLA's all-to-all, and a step that overflows NCCL
EP's receive buffer stopped with an error naming `ragged_buffer_factor`. The processes run
`nccl_ep_worker.py`; skipped without two GPUs, TE, or a libnccl.so.2 new enough for NCCL EP."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from maxtext_moe.run.distributed import free_port
from maxtext_moe.tools import doctor, library_versions

WORKER = Path(__file__).with_name("nccl_ep_worker.py")


def _nccl_ep_missing() -> str | None:
    if sum(d.platform == "gpu" for d in jax.devices()) < 2:
        return "needs 2 GPUs"
    if importlib.util.find_spec("transformer_engine") is None or library_versions.nccl_ep_lib_path() is None:
        return "needs Transformer Engine with libnccl_ep.so"
    code = library_versions.loaded_nccl_code()
    if code is None or library_versions.nccl_version(code) < doctor.NCCL_EP_MIN:
        return f"needs libnccl.so.2 >= {doctor.NCCL_EP_MIN} (NCCL EP), found {code}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_nccl_ep_missing() is not None, reason=str(_nccl_ep_missing()))]


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("nccl_ep") / "found.json"
    port, procs, logs = free_port(), [], []
    for i in range(2):
        env = dict(
            os.environ,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
            JAX_LOCAL_DEVICE_IDS=str(i),
            XLA_PYTHON_CLIENT_PREALLOCATE="false",  # this pytest process holds GPU memory already
        )
        log = out.with_name(f"p{i}.log").open("w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(out)], env=env, stdout=log, stderr=log))
    rcs = [p.wait(timeout=400) for p in procs]
    for log in logs:
        log.close()
    text = "\n".join(out.with_name(f"p{i}.log").read_text()[-3000:] for i in range(2))
    assert rcs == [0, 0], text
    return json.loads(out.read_text())


def test_nccl_ep_layer_matches_the_all_to_all_layer(found: dict) -> None:
    assert found["ranks"] == 2 and found["finite"], found
    assert found["rel_y"] < 2e-2, found  # BF16 tokens: NCCL EP combines in its own order and precision
    assert found["rel_grads"] and all(v < 5e-2 for v in found["rel_grads"].values()), found["rel_grads"]


def test_nccl_ep_overflow_stops_the_step_naming_the_key(found: dict) -> None:
    error = found["overflow_error"]
    assert error is not None, "a routing past the receive capacity ran through"
    assert "EP receive buffer overflow" in error and "ragged_buffer_factor=1.5" in error, error
