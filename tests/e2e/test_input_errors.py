"""Bad input is refused at once, in one line, before any file is written (real CLI subprocesses)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli


def _one_error_line(r) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("maxtext-moe: error: "), r.stderr
    return lines[0]


def test_exponent_numbers_are_numbers_on_the_command_line_and_in_recipe_files(recipe_file):
    path = recipe_file(
        "include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu]\nmaxtext: {learning_rate: 3e-05}\n"
    )
    for args, want in (
        (("deepseek3-tiny-cpu", "learning_rate=3e-4"), 3e-4),
        (("deepseek3-tiny-cpu", "learning_rate=3e-05"), 3e-5),
        (("deepseek3-tiny-cpu", "learning_rate=1.0e+6"), 1.0e6),
        ((str(path),), 3e-5),
    ):
        r = run_cli("show", *args, "--json")
        assert r.returncode == 0, (args, r.stderr)
        assert json.loads(r.stdout)["maxtext"]["learning_rate"] == want
    r = run_cli("show", "deepseek3-tiny-cpu", "steps=1e3", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["maxtext"]["steps"] == 1000, r.stderr
    assert "steps: must be an integer" in _one_error_line(run_cli("show", "deepseek3-tiny-cpu", "steps=1.5e0"))
    r = run_cli("show", "deepseek3-tiny-cpu", "run_name=1e3", "--json")
    assert json.loads(r.stdout)["maxtext"]["run_name"] == "1e3", "a string key keeps its text"


def test_keys_maxtext_moe_sets_itself_are_refused(tmp_path):
    line = _one_error_line(
        run_cli("train", "metrics_file=/tmp/m.jsonl", f"base_output_directory={tmp_path}", timeout=60)
    )
    assert "metrics_file:" in line and "metrics.jsonl" in line
    line = _one_error_line(run_cli("show", "deepseek3-tiny-cpu", "grain_train_files=/data/x*.arrayrecord"))
    assert "grain_train_files:" in line and "corpus" in line
    assert not any(tmp_path.iterdir())


def test_launch_refuses_a_bad_time_and_an_image_with_spaces():
    ok = run_cli("launch", "deepseek3-tiny-cpu", "--nodes", "1", "--slurm", "--time", "2-12:30")
    assert ok.returncode == 0 and "#SBATCH --time=2-12:30\n" in ok.stdout, ok.stderr
    line = _one_error_line(run_cli("launch", "deepseek3-tiny-cpu", "--nodes", "1", "--slurm", "--time", "banana"))
    assert "--time" in line and "banana" in line
    line = _one_error_line(run_cli("launch", "deepseek3-tiny-cpu", "--nodes", "1", "--k8s", "--image", "my image:1"))
    assert "--image" in line


def test_maxtext_rejects_a_key_in_one_line_before_the_run_folder_or_corpus_is_written(tmp_path):
    for override, text in (
        ("attention=foo", "attention: MaxText has no attention kernel 'foo'"),
        ("dtype=float33", "dtype:"),
    ):
        r = run_cli("train", override, f"base_output_directory={tmp_path}", timeout=120)
        assert text in _one_error_line(r), r.stderr
        assert not any(tmp_path.iterdir()), f"{override}: the run folder or the corpus was written"


def test_a_gpu_recipe_without_a_gpu_is_refused_before_anything_is_written(tmp_path):
    import jax

    if jax.default_backend() == "gpu":
        return
    for extra in ((), ("moe.impl=maxtext",)):
        r = run_cli("train", "deepseek3-proxy-h200-1gpu", *extra, f"base_output_directory={tmp_path}", timeout=120)
        line = _one_error_line(r)
        assert "this recipe runs on h200 GPUs; jax sees none here" in line and "Fix:" in line
        assert not any(tmp_path.iterdir())


def test_a_layout_the_plan_does_not_fit_is_warned_of_before_compiling(tmp_path):
    """bench (and train) of a GPU recipe print the plan's verdict before jax starts; here, without a GPU, the run
    then stops at the GPU check, before anything is compiled or written."""
    from maxtext_moe.plan import compile_route

    if compile_route.local_gpus():
        pytest.skip("on a GPU machine this would compile the layout and run out of memory (tests/unit/test_fit.py)")
    args = ("deepseek3-proxy-h200-1gpu", "max_target_length=8192", "per_device_batch_size=5")
    r = run_cli("bench", *args, f"base_output_directory={tmp_path}", timeout=120)
    warning, error = [line for line in r.stderr.splitlines() if line.strip()]
    assert warning.startswith("maxtext-moe: warning: the planner puts deepseek3-proxy-h200-1gpu (1 device on 1 h200, ")
    assert "at 132.2 GiB per GPU of 123.0 GiB usable on h200: XLA will likely run out of memory" in warning
    assert "`per_device_batch_size=2` (84.3 GiB" in warning
    assert r.returncode == 2 and error.startswith("maxtext-moe: error: ") and "jax sees none here" in error
    assert not any(tmp_path.iterdir())
    r = run_cli("bench", "deepseek3-proxy-h200-1gpu", f"base_output_directory={tmp_path}", timeout=120)
    assert "warning" not in r.stderr  # the recipe as shipped fits
