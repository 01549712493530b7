"""Scanned decoder layers with TE's grouped GEMM under expert parallelism, compiled for two H200s without them
(XLA:GPU deviceless; needs JAX's CUDA plugin and TE, not a GPU).

JAX 0.11.2's XLA crashes on the gradient of a shard_map that a zero-size array crosses; TE's grouped GEMM
leads there inside `jax.lax.scan` (docs/UPSTREAM.md, scripts/repro/zero_size_residual_in_scan.py). Our block
binds the GEMM as one primitive (`upstream/opaque_vjp.py`), so the two-GPU proxy compiles scanned."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, compile_without_gpu

from maxtext_moe.recipe.hardware import profile
from maxtext_moe.upstream import deviceless

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not deviceless.available(), reason="needs JAX's CUDA plugin (the gpu extra)"),
]
REPRO = REPO / "scripts" / "repro" / "zero_size_residual_in_scan.py"
NO_GPU = {"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1"}


def _repro(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    target = tmp_path / "h200.txtpb"
    target.write_text(deviceless.target_config(profile("h200")), encoding="utf-8")
    cmd = [sys.executable, str(REPRO), "--kernel", "te", "--target-config", str(target), *args]
    return subprocess.run(cmd, env=dict(os.environ, **NO_GPU), capture_output=True, text=True, timeout=600)


def test_te_grouped_gemm_in_a_differentiated_scan_still_crashes_xla(tmp_path: Path) -> None:
    """TE's own grouped GEMM, unwrapped: unrolled compiles, scanned dies with SIGSEGV in pinned JAX 0.11.2.
    When the scanned compile passes, JAX fixed it: `opaque_vjp` can go (JAX 0.12.0.1 compiles it)."""
    unrolled = _repro(tmp_path, "--unrolled")
    assert unrolled.returncode == 0 and "compiled" in unrolled.stdout, unrolled.stderr[-2000:]
    assert _repro(tmp_path).returncode == -11


def test_the_two_gpu_proxy_compiles_with_scanned_layers() -> None:
    result = compile_without_gpu("deepseek3-proxy-h200-2gpu", "scan_layers=true")
    assert result["route"] == "gpu-aot" and result["compiled"]["devices"] == 2
    assert result["compiled"]["mesh"]["expert"] == 2


DSF_REPRO = REPO / "scripts" / "repro" / "dynamic_slice_fusion_duplicates_gemm_in_scan.py"


def _gemms_per_loop(tmp_path: Path, *args: str) -> list[int]:
    target = tmp_path / "h200.txtpb"
    target.write_text(deviceless.target_config(profile("h200")), encoding="utf-8")
    cmd = [sys.executable, str(DSF_REPRO), "--target-config", str(target), *args]
    r = subprocess.run(cmd, env=dict(os.environ, **NO_GPU), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])["gemms_per_loop_body"]


def test_dynamic_slice_fusion_still_runs_a_saved_gemm_twice_in_a_scanned_forward(tmp_path: Path) -> None:
    """TE's grouped GEMM whose output the remat policy saves, in a differentiated scan: XLA's dynamic-slice
    fusion leaves two GEMMs in the forward loop, one without it. When both give one, XLA fixed it and
    `configs/moe/ours-te.yml` can drop the flag."""
    assert _gemms_per_loop(tmp_path) == [2, 2]
    assert _gemms_per_loop(tmp_path, "--no-dynamic-slice-fusion") == [1, 2]


def test_the_scanned_proxy_runs_each_expert_gemm_once_in_its_forward_loop(tmp_path: Path) -> None:
    """The one-GPU proxy scanned (batch 2, within an H200): the MoE layers' forward loop runs the expert GEMMs
    once each (gate and up as one, then down), the backward loop two GEMMs (input and weight gradients) for each."""
    dump = tmp_path / "hlo"
    compile_without_gpu(
        "deepseek3-proxy-h200-1gpu", "scan_layers=true", "per_device_batch_size=2", f"xla_flags.xla_dump_to={dump}"
    )
    (hlo,) = dump.glob("*jit_train_step*after_optimizations.txt")
    spec = importlib.util.spec_from_file_location("dsf_repro", DSF_REPRO)
    repro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(repro)
    assert repro.gemms_per_loop(hlo.read_text()) == [2, 4]
