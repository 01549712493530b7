"""Per-layer MoE load balance from a real CPU training run of the tiny recipe, unrolled layers (`scan_layers=false`)
with MaxText's own block (the recipe's default): in metrics.jsonl, in the TensorBoard event file, and on the
terminal. Scanned layers and our block: tests/e2e/test_moe_integration.py; expert parallelism: test_moe_ep.py."""

from __future__ import annotations

import re

import pytest
from conftest import FAST, read_metrics, run_cli, tensorboard_scalars

from maxtext_moe.moe import balance

pytestmark = pytest.mark.slow
RUN = "deepseek3-tiny-cpu"
STEPS = 3
LAYERS = ("layer_001", "layer_002", "layer_003", "mtp_1")  # layer 0 is dense


def test_unrolled_run_reports_each_layers_balance_everywhere(tmp_path):
    r = run_cli(
        "train",
        RUN,
        *FAST,
        f"steps={STEPS}",
        "corpus.max_mib=1",
        "scan_layers=false",
        f"base_output_directory={tmp_path}",
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = read_metrics(tmp_path / RUN)
    stats = (*balance.LOAD_STATS, *balance.BIAS_STATS)
    keys = {f"moe/{s}/{x}" for s in stats for x in LAYERS}
    assert sorted(metrics) == list(range(STEPS))
    for step, m in metrics.items():
        assert keys <= set(m) and not any(k.startswith("moe/") for k in set(m) - keys), sorted(set(m) - keys)
        for x in LAYERS:
            busiest, mean, share = (m[f"moe/{s}/{x}"] for s in balance.LOAD_STATS)
            assert busiest == int(busiest) and mean < busiest <= 2 * 128 and 0 < share < 1, (step, x, m)
            # every layer routes each of the batch's 2 x 128 tokens to the same number of experts
            assert busiest / share == pytest.approx(
                metrics[0][f"moe/tokens_max/{x}"] / metrics[0][f"moe/top_share/{x}"]
            )
    assert len({metrics[0][f"moe/tokens_max/{x}"] for x in LAYERS}) > 1  # per layer, not one figure repeated

    events = list((tmp_path / RUN / "tensorboard").rglob("events.out.tfevents.*"))
    assert len(events) == 1, events
    board = tensorboard_scalars(events[0])
    for key in keys:
        assert board[key] == pytest.approx({step: m[key] for step, m in metrics.items()}, rel=1e-6), key

    lines = [line for line in r.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == STEPS
    for line, m in zip(lines, metrics.values(), strict=True):
        shown = re.search(r"\| imb (\d+\.\d\d)x (L\d|MTP1) \|", line)
        assert shown, line
        ratio, worst = max((m[f"moe/tokens_max/{x}"] / m[f"moe/tokens_mean/{x}"], x) for x in LAYERS)
        assert shown.groups() == (f"{ratio:.2f}", "MTP1" if worst == "mtp_1" else f"L{int(worst[-3:])}"), line
