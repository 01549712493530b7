"""Shared helpers: run the real CLI in a subprocess, write recipe files, read run outputs."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from maxtext_moe.run import progress

REPO = Path(__file__).resolve().parents[1]

# Small enough for a few seconds per step on 2 cores, big enough that loss moves.
FAST = ["per_device_batch_size=2", "max_target_length=128", "log_period=5"]


def run_cli(
    *args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m maxtext_moe ARGS` as a user would run it."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "maxtext_moe", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Step -> MaxText's scalars from the run's metrics file (a resumed run appends)."""
    return progress.read_metrics(run_dir / "metrics.jsonl")


def tensorboard_tags(event_file: Path) -> set[str]:
    """Scalar tags in a TensorBoard event file, parsed from its TFRecord framing."""
    from tensorboardX.proto import event_pb2

    data = event_file.read_bytes()
    tags, pos = set(), 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        tags |= {v.tag for v in event.summary.value}
        pos += 12 + length + 4
    return tags


@pytest.fixture
def recipe_file(tmp_path):
    """Write a recipe YAML under tmp_path and return its path."""

    def write(text: str, name: str = "my-recipe.yml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write
