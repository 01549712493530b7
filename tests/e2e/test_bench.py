"""`maxtext-moe bench` on the CPU: real steps, a summary consistent with MaxText's own per-step log, and
(--profile) a trace of two warm-up steps summarised by kernel category, also by `python -m
maxtext_moe.tools.profile` from the trace on disk."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys

import pytest
from conftest import FAST, REPO, benchmark, read_metrics, run_cli

pytestmark = pytest.mark.slow


def test_bench_reports_the_timed_steps(tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli(
        "bench",
        "deepseek3-tiny-cpu",
        "--steps",
        "4",
        "--warmup",
        "3",
        "--out",
        str(out),
        f"base_output_directory={tmp_path}",
        *FAST,
        "corpus.max_mib=1",
        "--profile",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["warmup_steps"] == 4  # --profile adds one untimed step: the profiler stops in it
    assert result["timed_steps"] == 4 and result["moe"] == {"impl": "maxtext"}
    run = tmp_path / "deepseek3-tiny-cpu-bench"
    metrics = read_metrics(run)
    assert sorted(metrics) == list(range(8))
    # MaxText's block is timed as MaxText ships it: no extra top-k for the load-balance report.
    assert not [k for k in metrics[7] if k.startswith("moe/")]
    times = [metrics[s]["perf/step_time_seconds"] for s in range(4, 8)]
    assert result["step_s_median"] == pytest.approx(statistics.median(times))
    assert result["tokens_per_step"] == 2 * 128
    assert result["tokens_per_s_per_gpu"] == pytest.approx(256 / result["step_s_median"])
    assert result["loss_finite_and_falling"] and result["loss_last"] < result["loss_first"]
    assert result["losses"] == [metrics[s]["learning/loss"] for s in range(4, 8)]
    assert result["predicted_step_s"] is None and result["mfu_bf16"] is None  # the CPU has no peak to compare
    # The environment it ran with (the memory fraction the planner's usable memory depends on, on a GPU).
    assert result["env"]["JAX_PLATFORMS"] == "cpu" and result["device_memory_limit_gib"] is None
    assert not (run / "checkpoints").exists()
    assert "step time" in r.stdout and "model TFLOPS/GPU" in r.stdout

    prof = result["profile"]
    assert prof["source"].startswith("host XLA ops") and len(prof["kernels"]) == 25
    categories = dict(prof["categories"])
    assert categories["GEMM (cuBLAS/XLA dot)"] > 0 and sum(categories.values()) == pytest.approx(prof["total_ms"])
    assert "profile (warm-up)" in r.stdout and "of the median step" in r.stdout and "idle (step time" in r.stdout
    stages = dict(prof["stages"])  # from the step's HLO, which --profile dumps beside the trace
    assert stages["dense GEMMs"] > 0 and stages["optimizer"] > 0
    assert sum(stages.values()) == pytest.approx(prof["total_ms"])
    assert "routing, permute, unpermute" not in stages  # MaxText's block names no stages of its own
    assert prof["stage_tflop_per_step"]["dense GEMMs"] > 0 and prof["hlo"].endswith("after_optimizations.txt")
    assert "  busy /host:CPU" in r.stdout
    for plane in prof["per_plane"]:
        assert 0 < plane["busy_ms"] <= min(plane["kernel_ms"], plane["span_ms"]) + 1e-6

    summary = tmp_path / "profile.json"
    p = subprocess.run(
        [sys.executable, "-m", "maxtext_moe.tools.profile", str(run), "--top", "5", "--out", str(summary)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(summary.read_text())["categories"] == prof["categories"]
    assert "category" in p.stdout and "HLO op" in p.stdout and "busy" in p.stdout

    # The loss-curve comparison on this run's losses: equal to itself; 5% higher is outside 1%.
    curves = [sys.executable, str(REPO / "benchmarks/loss_curves.py"), str(out), "--window", "2", "--every", "1"]
    same = subprocess.run([*curves, str(out)], capture_output=True, text=True, timeout=60)
    assert same.returncode == 0 and "gap +0.00% (tolerance 1.00%): within" in same.stdout, same.stderr
    assert same.stdout.count("| 1.0000 |") == 4  # a row per timed step, ratio 1
    higher = tmp_path / "higher.json"
    higher.write_text(json.dumps(dict(result, losses=[1.05 * v for v in result["losses"]])))
    worse = subprocess.run([*curves, str(higher), "--json", str(tmp_path / "v.json")], capture_output=True, text=True)
    assert worse.returncode == 1 and "gap +5.00% (tolerance 1.00%): OUTSIDE" in worse.stdout
    assert json.loads((tmp_path / "v.json").read_text())["within"] is False
    # A run cut short leaves only its log: its progress lines after the warm-up stand in for the JSON's losses.
    log = tmp_path / "bench.log"
    log.write_text("\n".join(_cut_after_step(r.stdout, 6)))
    cut = subprocess.run(
        [*curves, str(log), "--warmup", "4", "--json", str(tmp_path / "c.json")], capture_output=True, text=True
    )
    assert cut.returncode == 0 and "last 2 of the 2 timed steps both ran" in cut.stdout, cut.stdout + cut.stderr
    assert json.loads((tmp_path / "c.json").read_text())["other"] == pytest.approx(result["losses"][:2], abs=5e-5)
    longer = tmp_path / "longer.json"
    longer.write_text(json.dumps(dict(result, timed_steps=8, losses=result["losses"] * 2)))
    other_schedule = subprocess.run([*curves, str(longer)], capture_output=True, text=True)
    assert other_schedule.returncode == 1 and "compare runs with the same schedule" in other_schedule.stderr


def _cut_after_step(stdout: str, last: int) -> list[str]:
    """The bench's output as if the run had stopped after step `last` (1-based, as printed)."""
    lines = stdout.splitlines()
    end = next(i for i, line in enumerate(lines) if line.startswith(f"step {last + 1:>5}/"))
    return lines[:end]


def test_profile_needs_the_warm_up_steps_it_traces(tmp_path):
    r = run_cli("bench", "deepseek3-tiny-cpu", "--warmup", "2", "--profile", f"base_output_directory={tmp_path}")
    assert r.returncode != 0
    assert "--profile traces warm-up steps 1-2, so it needs 3 or more warm-up steps, got 2" in r.stderr


def test_busy_time_counts_overlapping_kernels_once():
    from maxtext_moe.tools.profile import busy_ns

    assert busy_ns([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert busy_ns([(20, 30), (0, 10)]) == 20 and busy_ns([]) == 0


def test_attention_benchmark_checks_and_times_causal_attention(tmp_path):
    """benchmarks/bench_attention.py on the CPU (attention written out for XLA; on a GPU it times cuDNN's):
    the checks against the float32 reference pass, and the rates are the FLOPs over the medians it timed."""
    out = tmp_path / "attention.json"
    shape = {"batch": 2, "seq": 64, "heads": 4, "d_qk": 24, "d_v": 16}
    args = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    script = REPO / "benchmarks/bench_attention.py"
    r = subprocess.run(
        [sys.executable, str(script), *args, "--implementation", "einsum", "--iters", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["rel_err_out"] < 1e-2 and res["rel_err_dq"] < 2e-2  # bfloat16 against float32
    fwd, both = res["forward"]["median_ms"], res["forward_backward"]["median_ms"]
    # Sub-millisecond CPU timings on a loaded test machine need not order (a forward once timed 4.5 ms beside a
    # 0.84 ms forward+backward), so only the arithmetic on them is checked.
    assert fwd > 0 and both > 0 and res["backward_ms"] == pytest.approx(both - fwd)
    causal_fwd = 2 * 2 * 64 * 64 / 2 * 4 * (24 + 16)
    assert res["forward_tflops"] == pytest.approx(causal_fwd / (fwd * 1e-3) / 1e12)
    assert res["backward_tflops"] == pytest.approx(2 * causal_fwd / ((both - fwd) * 1e-3) / 1e12)
    assert "rel err out" in r.stdout


def test_layer_benchmarks_take_the_cotangent_as_an_argument_not_a_compiled_constant():
    """The layer benchmarks' timed step (`grad_fn`) gets the output's cotangent as an argument. Closed over, it
    became a literal in the HLO, and XLA folded what reads it at compile time: on an H200, constant-folding TE's
    amax of the output gradient used up the dense benchmark's time limit, and a folded amax is a cast the step no
    longer times."""
    import jax
    import jax.numpy as jnp

    grad_fn = benchmark("bench_moe_layer").grad_fn
    w, x = jnp.ones((32, 32), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), (64, 32), jnp.float32)
    step = grad_fn(lambda w, x: x @ w)
    hlo = step.lower(w, x, cot).as_text()
    literals = re.findall(r"constant dense<[^>]*>", hlo)
    assert max(map(len, literals), default=0) < 100, "a tensor-sized literal in the timed step's HLO"
    (_, dx), _ = step(w, x, cot)
    expected = cot @ w.T.astype(jnp.float32)
    assert jnp.linalg.norm(dx.astype(jnp.float32) - expected) < 1e-2 * jnp.linalg.norm(expected)


def test_dense_benchmark_checks_each_projection_against_float32(tmp_path):
    """benchmarks/bench_dense_fp8.py on the CPU (BF16 only; TE's FP8 needs a GPU): every projection of the proxy is
    checked against float32 and timed, and a variant that cannot run is reported per projection, not fatal."""
    out = tmp_path / "dense.json"
    script = REPO / "benchmarks/bench_dense_fp8.py"
    args = ["--tokens", "64", "--shrink", "64", "--only", "wkv_b,shared_wo", "--iters", "2", "--warmup", "1"]
    r = subprocess.run(
        [sys.executable, str(script), *args, "--variants", "bf16,nonesuch", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [(run["name"], run["variant"]) for run in runs] == [
        ("wkv_b", "bf16"), ("wkv_b", "nonesuch"), ("shared_wo", "bf16"), ("shared_wo", "nonesuch"),
    ]  # fmt: skip
    timed = [run for run in runs if run["variant"] == "bf16"]
    assert [(run["k"], run["n"]) for run in timed] == [(512 // 64, 32768 // 64), (2048 // 64, 7168 // 64)]
    assert all(max(run["rel_err_out"], run["rel_err_dx"], run["rel_err_dw"]) < 1e-2 for run in timed)
    assert all(run["tflops"] == pytest.approx(6 * 64 * run["k"] * run["n"] / (run["median_ms"] * 1e-3) / 1e12)
               for run in timed)  # fmt: skip
    assert all("unknown variant" in run["error"] for run in runs if run["variant"] == "nonesuch")


def test_router_benchmark_checks_both_variants_against_float64(tmp_path):
    """benchmarks/bench_router.py on the CPU at a small shape: the layer's router dot and the float32 dot at
    HIGHEST each give logits equal to a float64 product to float32 summation and BF16-rounded gradients."""
    out = tmp_path / "router.json"
    args = ["--tokens", "256", "--width", "128", "--experts", "8", "--iters", "2", "--warmup", "1", "--out", str(out)]
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_router.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [run["variant"] for run in result["runs"]] == ["layer", "f32_highest"]
    assert all(run["rel_err_logits"] < 1e-6 for run in result["runs"])
    assert all(max(run["rel_err_dx"], run["rel_err_dw"]) < 4e-3 for run in result["runs"])  # BF16 gradients
    layer, highest = result["runs"]
    assert result["layer_over_f32_highest"] == pytest.approx(layer["median_ms"] / highest["median_ms"])


def test_attention_reference_is_causal():
    """The yardstick masks the future: changing the last key and value moves only the last query's output."""
    import jax
    import jax.numpy as jnp

    reference = benchmark("bench_attention").reference

    q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 4)) for i in range(3))
    base = reference(q, k, v, 0.5)
    moved = reference(q, k.at[:, -1].add(3.0), v.at[:, -1].add(3.0), 0.5)
    assert jnp.allclose(base[:, :-1], moved[:, :-1]) and not jnp.allclose(base[:, -1], moved[:, -1])


def test_receive_benchmark_times_two_formulations_that_agree(tmp_path):
    """benchmarks/bench_receive.py on the CPU at a small EP4 rank: the receive side as the block runs it and
    through a row for every slot give the same loss and gradients (to bfloat16 rounding), and both are timed."""
    out = tmp_path / "receive.json"
    shape = ["--tokens", "64", "--ranks", "4", "--experts", "4", "--emb", "32", "--mlp", "16", "--top-k", "4"]
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/bench_receive.py"), *shape, "--backend", "ragged_dot", "--iters", "2"]
        + ["--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert [run["variant"] for run in runs] == ["sorted", "every_slot"]
    assert all(run["median_ms"] > 0 and run["rows"] == 256 and run["slots"] == 4 for run in runs)
    assert runs[-1]["rel_err_loss"] < 1e-2 and runs[-1]["rel_err_grads_max"] < 2e-2
