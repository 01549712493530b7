"""The `training:` section in a real run: the tiny model on the CPU with DeepSeek-V3's schedule scaled down
(tests/schedule_case.py). The run's metrics must show each change at its step."""

from __future__ import annotations

import pytest
import schedule_case
from conftest import read_metrics, run_cli

pytestmark = pytest.mark.slow


def test_learning_rate_batch_gamma_and_mtp_weight_change_at_their_steps(recipe_file, tmp_path) -> None:
    path = recipe_file(schedule_case.recipe("hardware/cpu"), f"{schedule_case.NAME}.yml")
    r = run_cli("train", str(path), f"base_output_directory={tmp_path}", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    schedule_case.check(read_metrics(tmp_path / schedule_case.NAME))
