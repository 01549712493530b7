"""The progress line follows a real metrics file as MaxText appends to it."""

from __future__ import annotations

import json

from maxtext_moe.run.progress import Progress


def test_tokens_per_second_is_shown_from_the_second_step_on(tmp_path):
    path, lines = tmp_path / "metrics.jsonl", []
    with Progress(path, 3, out=lines.append, poll_s=0.01):
        with open(path, "a", encoding="utf-8") as f:
            for step, tps in ((0, 12.0), (1, 5000.0), (2, 5100.0)):
                m = {"step": step, "learning/loss": 5.0, "perf/per_device_tokens_per_sec": tps}
                f.write(json.dumps(m | {"perf/step_time_seconds": 1.0}) + "\n")
    assert len(lines) == 3
    assert "tokens/s" not in lines[0] and "12" not in lines[0].split("loss")[1], lines[0]
    assert "includes compilation" in lines[0]
    assert "5,000 tokens/s/device" in lines[1] and "5,100 tokens/s/device" in lines[2]
