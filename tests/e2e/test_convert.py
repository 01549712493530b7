"""`convert hf-to-orbax` on a DeepSeek-V3-shaped checkpoint that transformers' own DeepseekV3 model writes in
the published format (FP8 e4m3 with 128x128 scale blocks, per-expert keys, router bias, an MTP layer), in the
reference venv (.venv-hf, scripts/setup-hf-reference.sh); then MaxText's logits, training from it, peak memory,
and the one-line errors for a damaged shard, a missing index entry and a config that is not the recipe's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from conftest import FAST, REPO, run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.convert import hf_config, safetensors_io

HF_PYTHON = REPO / ".venv-hf" / "bin" / "python"
TOKENS = "1,5,9,200,3000,17,31999,42"
RECIPE = "deepseek3-tiny-cpu"
# Logits of MaxText's model against transformers', both float32 on the CPU from the same stored weights.
ATOL = 1e-4

pytestmark = pytest.mark.skipif(
    not HF_PYTHON.exists(),
    reason="no reference venv .venv-hf: run scripts/setup-hf-reference.sh (scripts/test.sh does)",
)


def _write_hf(folder, overrides: list[str], shards: int = 3):
    """A transformers-written checkpoint of the recipe's model, and transformers' logits for TOKENS."""
    folder.mkdir(parents=True)
    config = folder / "config-in.json"
    config.write_text(json.dumps(hf_config.for_recipe(resolve(RECIPE, overrides))))
    logits = folder / "reference.npy"
    subprocess.run(
        [str(HF_PYTHON), str(REPO / "tests/reference/hf_deepseek.py"), "write", str(config), str(folder / "hf")]
        + ["--tokens", TOKENS, "--logits", str(logits), "--shards", str(shards)],
        check=True,
        capture_output=True,
    )
    return folder / "hf", np.load(logits)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return _write_hf(tmp_path_factory.mktemp("convert") / "tiny", [])


def _maxtext_logits(out, overrides: list[str], tmp_path) -> np.ndarray:
    path = tmp_path / "maxtext.npy"
    subprocess.run(
        [sys.executable, str(REPO / "tests/reference/maxtext_logits.py"), str(out), RECIPE, *overrides]
        + ["--tokens", TOKENS, "--logits", str(path)],
        check=True,
        capture_output=True,
        cwd=REPO,
    )
    return np.load(path)


@pytest.mark.parametrize(
    "overrides", [[], ["scan_layers=false", "moe.impl=ours"]], ids=["scanned-maxtext", "unscanned-ours"]
)
def test_converted_model_gives_transformers_logits(hf, tmp_path, overrides):
    src, reference = hf
    out = tmp_path / "orbax"
    r = run_cli("convert", "hf-to-orbax", str(src), str(out), "--recipe", RECIPE, *overrides, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensors" in r.stdout and "ETA" in r.stdout, r.stdout
    assert not (tmp_path / "orbax.partial").exists()
    logits = _maxtext_logits(out, overrides, tmp_path)
    assert logits.shape == reference.shape
    assert np.abs(logits - reference).max() < ATOL, np.abs(logits - reference).max()
    assert np.abs(reference).max() > 100 * ATOL  # the comparison is not between two near-zero arrays


def test_train_starts_from_converted_weights(hf, tmp_path):
    src, _ = hf
    out = tmp_path / "orbax"
    assert run_cli("convert", "hf-to-orbax", str(src), str(out), "--recipe", RECIPE, cwd=REPO).returncode == 0
    r = run_cli("train", RECIPE, f"load_parameters_path={out}", "steps=1", *FAST, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     1/1 | loss" in r.stdout, r.stdout
    log = (tmp_path / "runs" / RECIPE / "maxtext.log").read_text()
    assert f"restoring params from {out}" in log


@pytest.mark.xfail(
    strict=True,
    reason="not met yet: peak RSS grows with the bytes written (121 MiB above baseline for 0.4 GB), docs/CONVERT.md",
)
def test_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    """Experts wide enough that one stacked array (100 MB) outweighs the bound; the child's peak RSS from rusage."""
    overrides = ["num_experts=64", "base_moe_mlp_dim=2048"]
    src, _ = _write_hf(tmp_path / "big", overrides)
    largest = 0
    for shard in src.glob("*.safetensors"):
        header, _ = safetensors_io.read_header(shard)
        largest = max(largest, *(int(np.prod(t["shape"])) * 4 for t in header.values()))  # float32 once read
    cmd = [sys.executable, "-m", "maxtext_moe", "convert", "hf-to-orbax", str(src), str(tmp_path / "out")]
    measure = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(r.stdout, r.stderr[-2000:]); print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    r = subprocess.run(
        [sys.executable, "-c", measure, *cmd, "--recipe", RECIPE, *overrides], capture_output=True, text=True, cwd=REPO
    )
    peak = int(r.stdout.rsplit("PEAK", 1)[1]) * 1024
    baseline = float(r.stdout.split("host memory before writing ")[1].split(" MiB")[0].replace(",", "")) * 2**20
    stacked = 3 * 64 * 64 * 2048 * 4  # one scanned array, the routed experts' wi_0: layers x experts x 64 x 2048
    bound = 3 * largest + 64 * 2**20  # the documented 3x largest tensor, plus allocator and tensorstore slack
    print(f"peak {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB")
    assert (tmp_path / "out").is_dir(), r.stdout[-3000:]
    assert stacked > bound  # holding the model, or one stacked array of it, would break the bound
    assert peak - baseline < bound, f"{(peak - baseline) / 2**20:.0f} MiB above baseline"


def _copy(src, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    return bad


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("maxtext-moe: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_wrong_model_config_names_both_keys(hf, tmp_path):
    bad = _copy(hf[0], tmp_path)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | {"n_routed_experts": 8}))
    r = run_cli("convert", "hf-to-orbax", str(bad), str(tmp_path / "out"), "--recipe", RECIPE, cwd=REPO)
    line = _one_line_error(r)
    assert "n_routed_experts is 8" in line and "num_experts is 16" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_missing_index_entry_names_the_key(hf, tmp_path):
    bad = _copy(hf[0], tmp_path)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.5.up_proj.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    r = run_cli("convert", "hf-to-orbax", str(bad), str(tmp_path / "out"), "--recipe", RECIPE, cwd=REPO)
    line = _one_line_error(r)
    assert "model.layers.2.mlp.experts.5.up_proj.weight" in line and "model.safetensors.index.json" in line, line
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_damaged_shard_names_the_shard_and_tensor(hf, tmp_path):
    bad = _copy(hf[0], tmp_path)
    shard = sorted(bad.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    r = run_cli("convert", "hf-to-orbax", str(bad), str(tmp_path / "out"), "--recipe", RECIPE, cwd=REPO)
    line = _one_line_error(r)
    assert shard.name in line and "damaged" in line and "tensor '" in line, line


def test_interrupted_conversion_restarts_and_never_leaves_out(hf, tmp_path):
    src, reference = hf
    out = tmp_path / "orbax"
    partial = tmp_path / "orbax.partial"
    (partial / "0" / "items").mkdir(parents=True)  # what a killed conversion leaves: no OUT, a partial folder
    (partial / "0" / "items" / "_METADATA").write_text("{")
    r = run_cli("convert", "hf-to-orbax", str(src), str(out), "--recipe", RECIPE, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left by an interrupted conversion" in r.stdout
    assert not partial.exists()
    assert np.abs(_maxtext_logits(out, [], tmp_path) - reference).max() < ATOL
