"""A full disk, on a real small tmpfs: refused before training when one checkpoint cannot fit, one line when a
checkpoint save runs out of space. Skipped where mounting a tmpfs is not permitted (not root, no mount)."""

from __future__ import annotations

import math
import subprocess

import pytest
from conftest import FAST, run_cli

from maxtext_moe.cli import resolve
from maxtext_moe.run import disk_space, run_dir

pytestmark = pytest.mark.slow
SMALL = [*FAST, "corpus.max_mib=1"]
RUN = "deepseek3-tiny-cpu"


@pytest.fixture
def tmpfs(tmp_path):
    """mount(MiB) -> a fresh tmpfs of that size under tmp_path, unmounted afterwards."""
    mounted = []

    def mount(mib: int):
        folder = tmp_path / f"tmpfs{len(mounted)}"
        folder.mkdir()
        try:
            cmd = ["mount", "-t", "tmpfs", "-o", f"size={mib}M", "tmpfs", str(folder)]
            r = subprocess.run(cmd, capture_output=True)
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


def _checkpoint_mib() -> int:
    return math.ceil(disk_space.checkpoint_bytes(resolve(RUN, SMALL)) / 2**20)


def test_too_little_room_for_one_checkpoint_is_refused_before_anything_is_written(tmpfs):
    out = tmpfs(_checkpoint_mib() // 2)
    r = run_cli("train", "steps=4", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"base_output_directory: {out} is on tmpfs (mounted on {out}, " in r.stderr
    assert "and one checkpoint of this model (parameters and optimizer state) needs up to " in r.stderr
    assert "loss" not in r.stdout and not any(out.iterdir())


def test_a_full_disk_during_a_checkpoint_save_gives_one_line(tmpfs):
    """Room for the first checkpoint, not the second: the save of step 2 fails. Orbax's writer threads log
    their tracebacks to maxtext.log; the terminal gets the step, the filesystem and the fix."""
    out = tmpfs(_checkpoint_mib() + 16)
    r = run_cli("train", "steps=4", "checkpoint_period=2", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    ckpt = out / RUN / "checkpoints"
    (error,) = r.stderr.splitlines()
    assert error.startswith(f"maxtext-moe: error: no space left on tmpfs (mounted on {out}, "), error
    assert f"while saving checkpoint 2 in {ckpt}; the latest complete checkpoint is step 0." in error
    assert f"Fix: free space on {out}" in error and "run the same command to resume" in error
    assert run_dir.scan(ckpt).complete == [0]
    assert "No space left on device" in (out / RUN / "maxtext.log").read_text()
