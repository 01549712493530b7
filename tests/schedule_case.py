"""DeepSeek-V3's schedule scaled down to 8 steps of the tiny model, and what a run's metrics must show of it: the
same case for the CPU (tests/e2e) and a GPU (tests/gpu).

Tokens are scaled so that each phase starts at a chosen step (128-token sequences, 2 per micro-batch, 1 device):
the batch ramps 2 -> 3 -> 4 sequences over steps 0-1 (4 is 2 micro-batches), the learning rate warms up over
steps 0-1, holds to step 4, decays by cosine to step 6 and drops again at step 7; gamma turns 0 at step 6 and the
MTP weight halves at step 4.
"""

from __future__ import annotations

import pytest

from maxtext_moe.recipe.timeline import Timeline

SEQ = 128
STEPS = 8
NAME = "schedule-tiny"
TRAINING = """
maxtext:
  {maxtext}
  per_device_batch_size: 2
  max_target_length: 128
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


def recipe(hardware: str, maxtext: str = "") -> str:
    """The tiny model with this schedule on one device of `hardware` (a fragment), with one more line for its
    `maxtext:` section."""
    include = f"base/maxtext-moe, model/deepseek3-tiny, {hardware}, parallelism/single-device, data/synthetic"
    return (
        f"description: DeepSeek-V3's schedule scaled to 8 steps of the tiny model\ninclude: [{include}]\n"
        "topology:\n  gpus_per_node: 1\n" + TRAINING.format(maxtext=maxtext)
    )


def check(m: dict[int, dict]) -> None:
    """The run's metrics show every schedule change at its step."""
    assert sorted(m) == list(range(STEPS))

    def column(key: str) -> list[float]:
        return [round(m[s][key], 7) for s in range(STEPS)]

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
    assert [round(line.lr_at(s), 7) for s in range(STEPS)] == column("learning/current_learning_rate")
