"""`convert` both ways on a DeepSeek-V3-shaped checkpoint that transformers' own DeepseekV3 model writes in the
published format (FP8 e4m3 with 128x128 scale blocks, per-expert keys, router bias, an MTP layer), in the
reference venv (.venv-hf, scripts/setup-hf-reference.sh): MaxText's logits on the converted weights, training from
them, the round trip back to Hugging Face, a training run's checkpoint loaded by transformers, peak memory both
ways, and the one-line errors. One conversion and one training run are shared by the tests (module fixtures)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from conftest import FAST, REPO, run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.convert import hf_config, layout, safetensors_io
from maxtext_moe.convert.hf_checkpoint import SCALE, HfCheckpoint
from maxtext_moe.run import run_dir

HF_PYTHON = REPO / ".venv-hf" / "bin" / "python"
TOKENS = "1,5,9,200,3000,17,31999,42"
RECIPE = "deepseek3-tiny-cpu"
# Logits of MaxText's model against transformers', both float32 on the CPU from the same stored weights.
ATOL = 1e-4
# transformers' logits from the BF16 safetensors orbax-to-hf writes, against MaxText's from the float32 checkpoint
# (measured 2.7e-3 and 4.4e-3 on the tiny model; leaving out the router's bias gives 2.6e-2).
BF16_ATOL = 1e-2
# Experts wide enough that one stacked array (100 MB) outweighs the memory bound.
BIG = ["num_experts=64", "base_moe_mlp_dim=2048"]

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


@pytest.fixture(scope="module")
def converted(hf, tmp_path_factory):
    """`hf` converted once (scanned, MaxText's block) for the tests below, over the `OUT.partial` that a killed
    conversion leaves: no OUT, a partial folder with half-written metadata."""
    out = tmp_path_factory.mktemp("converted") / "orbax"
    partial = out.with_name("orbax.partial")
    (partial / "0" / "items").mkdir(parents=True)
    (partial / "0" / "items" / "_METADATA").write_text("{")
    return out, run_cli("convert", "hf-to-orbax", str(hf[0]), str(out), "--recipe", RECIPE, cwd=REPO)


@pytest.fixture(scope="module")
def trained(converted, tmp_path_factory):
    """One training step from the converted weights: the run folder, with its checkpoint, and the run's output."""
    cwd = tmp_path_factory.mktemp("train")
    r = run_cli("train", RECIPE, f"load_parameters_path={converted[0]}", "steps=1", *FAST, cwd=cwd)
    return cwd / "runs" / RECIPE, r


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


def _transformers_logits(folder, tmp_path) -> np.ndarray:
    """transformers' DeepseekV3ForCausalLM loaded from `folder`; the script fails on a missing or misshapen weight."""
    path = tmp_path / "transformers.npy"
    r = subprocess.run(
        [str(HF_PYTHON), str(REPO / "tests/reference/hf_deepseek.py"), "load", str(folder)]
        + ["--tokens", TOKENS, "--logits", str(path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(path)


def _assert_close(logits: np.ndarray, reference: np.ndarray, atol: float) -> None:
    assert logits.shape == reference.shape
    assert np.abs(logits - reference).max() < atol, np.abs(logits - reference).max()
    assert np.abs(reference).max() > 10 * atol  # the comparison is not between two near-zero arrays


def test_converted_model_gives_transformers_logits(hf, converted, tmp_path):
    out, r = converted
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tensors" in r.stdout and "ETA" in r.stdout, r.stdout
    _assert_close(_maxtext_logits(out, [], tmp_path), hf[1], ATOL)


def test_unscanned_fused_conversion_for_our_block_gives_transformers_logits_and_round_trips(hf, tmp_path):
    """Unscanned layers, with MaxText's `prefuse_moe_weights` tree: gate_proj and up_proj in one `wi`, which our
    block reads as MaxText's does (the scanned, unfused layout is the module's shared conversion)."""
    overrides = ["scan_layers=false", "moe.impl=ours", "prefuse_moe_weights=true"]
    out = tmp_path / "orbax"
    r = run_cli("convert", "hf-to-orbax", str(hf[0]), str(out), "--recipe", RECIPE, *overrides, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_close(_maxtext_logits(out, overrides, tmp_path), hf[1], ATOL)
    back = tmp_path / "hf"
    r = run_cli("convert", "orbax-to-hf", str(out), str(back), "--recipe", RECIPE, *overrides, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    _assert_same_tensors(hf[0], back)


def test_interrupted_conversion_restarts_and_never_leaves_out(converted):
    out, r = converted
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left by an interrupted conversion" in r.stdout
    assert not out.with_name("orbax.partial").exists()
    assert (out / "items" / "_METADATA").is_file()


def test_train_starts_from_converted_weights(converted, trained):
    run, r = trained
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     1/1 | loss" in r.stdout, r.stdout
    assert f"restoring params from {converted[0]}" in (run / "maxtext.log").read_text()


def test_round_trip_gives_the_same_tensors(hf, converted, tmp_path):
    """hf -> orbax -> hf: every tensor back under its name; BF16 ones bit for bit, FP8 ones as their dequantized
    values rounded to BF16, the router's bias in float32 as it was. Run over what a killed run leaves: a partial
    folder with a shard and no index."""
    back = tmp_path / "hf"
    (tmp_path / "hf.partial").mkdir()
    (tmp_path / "hf.partial" / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 64)
    r = run_cli("convert", "orbax-to-hf", str(converted[0]), str(back), "--recipe", RECIPE, "--max-shard-gib", "0.005")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "left by an interrupted conversion" in r.stdout
    assert not (tmp_path / "hf.partial").exists()
    assert len(HfCheckpoint(back).shards()) > 1
    _assert_same_tensors(hf[0], back)


def _assert_same_tensors(src, back) -> None:
    original, result = HfCheckpoint(src), HfCheckpoint(back)
    assert set(result.weight_map) == {k for k in original.weight_map if not k.endswith(SCALE)}
    for key in result.weight_map:
        want = original.get(key)
        if not key.endswith("e_score_correction_bias"):
            want = want.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(result.get(key), want, err_msg=key)


def test_training_checkpoint_converts_to_what_transformers_loads(trained, tmp_path):
    """The run's checkpoint (parameters beside optimizer state, the router's bias in `nnx_aux`) -> BF16 safetensors:
    transformers loads every weight, and its logits are MaxText's on that checkpoint, within BF16 rounding."""
    run, _ = trained
    out = tmp_path / "hf"
    r = run_cli("convert", "orbax-to-hf", str(run), str(out), "--recipe", RECIPE, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checkpoints/{run_dir.scan(run / 'checkpoints').latest}/items" in r.stdout, r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and "quantization_config" not in config
    step = run / "checkpoints" / str(run_dir.scan(run / "checkpoints").latest)
    _assert_close(_transformers_logits(out, tmp_path), _maxtext_logits(step, [], tmp_path), BF16_ATOL)


def test_orbax_to_hf_errors_name_the_step_and_the_model(trained, tmp_path):
    run, _ = trained
    out = tmp_path / "hf"
    r = run_cli("convert", "orbax-to-hf", str(run), str(out), "--recipe", RECIPE, "--step", "7", cwd=tmp_path)
    line = _one_line_error(r)
    assert "step 7" in line and "complete steps: [0]" in line, line
    r = run_cli("convert", "orbax-to-hf", str(run), str(out), "--recipe", RECIPE, "num_experts=8", cwd=tmp_path)
    line = _one_line_error(r)
    assert "num_experts" in line and f"--recipe {RECIPE}" in line, line
    assert not out.exists() and not (tmp_path / "hf.partial").exists()


@pytest.fixture(scope="module")
def big(hf, tmp_path_factory):
    """A checkpoint with experts wide enough that one stacked array (100 MB) outweighs the memory bound, in the
    published format (FP8 e4m3 linears with their block scales, BF16 elsewhere, float32 router bias, every key
    `layout.hf_shapes` names). Its values are random bytes: only its size matters here; the tiny checkpoint
    above, written by transformers, checks the format."""
    folder = tmp_path_factory.mktemp("big") / "hf"
    folder.mkdir()
    config = hf_config.for_recipe(resolve(RECIPE, BIG))
    quantized = {k.split(".")[-2] for k in HfCheckpoint(hf[0]).weight_map if k.endswith(SCALE)}  # as transformers'
    rng = np.random.default_rng(0)
    entries = []
    for key, shape in layout.hf_shapes(config, config["num_nextn_predict_layers"]).items():
        if key.split(".")[-2] in quantized:
            scale = (-(-shape[0] // 128), -(-shape[1] // 128))
            fp8 = rng.integers(0, 0x70, shape, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
            entries += [(key, fp8), (key + SCALE, rng.random(scale, dtype=np.float32) / 100)]
        elif key.endswith("e_score_correction_bias"):
            entries.append((key, rng.random(shape, dtype=np.float32)))
        else:
            entries.append((key, rng.random(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)))
    shard = "model.safetensors"
    writer = safetensors_io.ShardWriter(folder / shard, [(k, v.shape, v.dtype) for k, v in entries])
    for key, value in entries:
        writer.write(key, value)
    (folder / "config.json").write_text(json.dumps(config))
    largest = max(int(np.prod(v.shape)) * 4 for _, v in entries)  # float32 once read
    return folder, largest


def _peak(args: list[str]) -> tuple[int, int, str]:
    """`maxtext-moe ARGS` in a child: its peak RSS (rusage), and the RSS it reports before writing."""
    measure = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "print(r.stdout, r.stderr[-2000:]); print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    cmd = [sys.executable, "-c", measure, sys.executable, "-m", "maxtext_moe", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    peak = int(r.stdout.rsplit("PEAK", 1)[1]) * 1024
    baseline = float(r.stdout.split("host memory before writing ")[1].split(" MiB")[0].replace(",", "")) * 2**20
    print(f"peak {peak / 2**20:.0f} MiB, baseline {baseline / 2**20:.0f} MiB")
    return peak, baseline, r.stdout


def _bound(largest: int) -> int:
    """The documented bound above the baseline: 3x the largest tensor in float32, plus 48 MiB."""
    stacked = 3 * 64 * 64 * 2048 * 4  # one scanned array, the routed experts' wi_0: layers x experts x 64 x 2048
    bound = 3 * largest + 48 * 2**20
    assert stacked > bound  # holding the model, or one stacked array of it, would break the bound
    return bound


def test_peak_memory_is_bounded_by_the_largest_tensor_not_the_model(big, tmp_path_factory):
    """Both directions, on a model that writes 0.4 GB in float32 (0.2 GB back in BF16)."""
    src, largest = big
    orbax = src.with_name("orbax")
    peak, baseline, out = _peak(["convert", "hf-to-orbax", str(src), str(orbax), "--recipe", RECIPE, *BIG])
    assert (orbax / "items").is_dir(), out[-3000:]
    assert peak - baseline < _bound(largest), f"hf-to-orbax: {(peak - baseline) / 2**20:.0f} MiB above baseline"
    back = src.with_name("back")
    peak, baseline, out = _peak(["convert", "orbax-to-hf", str(orbax), str(back), "--recipe", RECIPE, *BIG])
    assert (back / "config.json").is_file(), out[-3000:]
    assert peak - baseline < _bound(largest), f"orbax-to-hf: {(peak - baseline) / 2**20:.0f} MiB above baseline"


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
