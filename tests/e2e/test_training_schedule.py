"""The `training:` section in a real run: the tiny model on the CPU with DeepSeek-V3's schedule scaled down.

Tokens are scaled so that each phase starts at a chosen step (128-token sequences, 2 per micro-batch, 1 device):
the batch ramps 2 -> 3 -> 4 sequences over steps 0-1 (4 is 2 micro-batches), the learning rate warms up over
steps 0-1, holds to step 4, decays by cosine to step 6 and drops again at step 7; gamma turns 0 at step 6 and the
MTP weight halves at step 4. The run's metrics must show each change at its step.
"""

from __future__ import annotations

import pytest
from conftest import read_metrics, run_cli

from maxtext_moe.recipe.timeline import Timeline

pytestmark = pytest.mark.slow
SEQ = 128
RECIPE = f"""
description: DeepSeek-V3's schedule scaled to 8 steps of the tiny model
include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device, data/synthetic]
maxtext:
  per_device_batch_size: 2
  max_target_length: {SEQ}
  log_period: 1
  enable_checkpointing: false
  enable_tensorboard: false
training:
  tokens: 3712              # step 8: 640 tokens in steps 0-1, then 512 a step
  batch_start: 2
  batch_end: 4
  ramp_tokens: 512          # batch 2 at step 0, 3 at step 1, 4 from step 2
  lr_peak: 0.002
  lr_warmup_steps: 2
  lr_constant_until: 1664   # step 4
  lr_cosine_until: 2688     # step 6
  lr_cosine_to: 0.0002
  lr_tail: {{3200: 0.0001}}   # step 7
  bias_update_rate: {{0: 0.001, 2688: 0}}
  mtp_weight: {{0: 0.1, 1664: 0.05}}
"""


def test_learning_rate_batch_gamma_and_mtp_weight_change_at_their_steps(recipe_file, tmp_path) -> None:
    path = recipe_file(RECIPE, "schedule-tiny.yml")
    r = run_cli("train", str(path), f"base_output_directory={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    m = read_metrics(tmp_path / "schedule-tiny")
    assert sorted(m) == list(range(8))

    def column(key: str) -> list[float]:
        return [round(m[s][key], 7) for s in range(8)]

    assert column("learning/current_learning_rate") == [0.0, 0.001, 0.002, 0.002, 0.002, 0.0011, 0.0002, 0.0001]
    assert column("schedule/batch") == [2, 3, 4, 4, 4, 4, 4, 4]
    assert column("learning/total_weights") == [b * SEQ for b in (2, 3, 4, 4, 4, 4, 4, 4)]  # tokens in the loss
    assert column("schedule/bias_update_rate") == [0.001] * 6 + [0.0] * 2
    assert column("schedule/mtp_weight") == [0.1] * 4 + [0.05] * 4
    # gamma at work: each step's sign update moves the biases by 0.001 until step 6's, which is 0
    bias = column("moe/bias_max/layer_001")
    moves = [round(abs(b - a), 7) for a, b in zip(bias, bias[1:], strict=False)]
    assert all(0 < d <= 0.001 for d in moves[:6]) and moves[6] == 0, bias
    # the MTP loss in the metrics is weighted: it halves where lambda does, against a steadily falling raw loss
    mtp = column("learning/mtp_loss")
    assert mtp[4] / mtp[3] == pytest.approx(0.5, rel=0.1)
    line = Timeline(
        tokens=3712,
        seq_len=SEQ,
        batch_start=2,
        batch_end=4,
        ramp_tokens=512,
        quantum=1,
        lr_peak=0.002,
        warmup_steps=2,
        lr_constant_until=1664,
        lr_cosine_until=2688,
        lr_cosine_to=0.0002,
        lr_tail=((3200, 0.0001),),
    )
    assert [round(line.lr_at(s), 7) for s in range(8)] == column("learning/current_learning_rate")
