"""The `training:` section's hooks on a GPU: the tiny model with DeepSeek-V3's schedule scaled down
(tests/schedule_case.py) trains on one GPU, and its metrics show each change at its step, as on the CPU."""

from __future__ import annotations

import jax
import pytest
import schedule_case
from conftest import read_metrics, run_cli

ON_GPU = jax.devices()[0].platform == "gpu"
# the tiny model's heads are narrower than cuDNN's fused attention takes
ATTENTION = "attention: dot_product"


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_learning_rate_batch_gamma_and_mtp_weight_change_at_their_steps_on_a_gpu(recipe_file, tmp_path) -> None:
    path = recipe_file(schedule_case.recipe("hardware/h200", maxtext=ATTENTION), f"{schedule_case.NAME}.yml")
    r = run_cli("train", str(path), f"base_output_directory={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    schedule_case.check(read_metrics(tmp_path / schedule_case.NAME))
