"""Real MaxText training on the CPU: loss, checkpoints, TensorBoard, resume, and run-folder guards.

Every test runs `python -m maxtext_moe train` in a subprocess, as a user would, on the embedded
default recipe shrunk by overrides (shorter sequences, a 1 MiB corpus) so the suite stays fast.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys

import pytest
from conftest import FAST, read_metrics, run_cli, tensorboard_tags

from maxtext_moe.run import run_dir

pytestmark = pytest.mark.slow
SMALL = [*FAST, "corpus.max_mib=1"]
RUN = "deepseek3-tiny-cpu"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 30-step run of the default recipe (checkpoints at 0, 10, 20 and the last step)."""
    out = tmp_path_factory.mktemp("trained")
    r = run_cli("train", "steps=30", "checkpoint_period=10", f"base_output_directory={out}", *SMALL, cwd=out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r


def test_default_recipe_trains_on_real_text(trained):
    out, r = trained
    metrics = read_metrics(out / RUN)
    assert sorted(metrics) == list(range(30))
    first = statistics.mean(metrics[s]["learning/loss"] for s in range(5))
    last = statistics.mean(metrics[s]["learning/loss"] for s in range(25, 30))
    assert last < first - 2.0, (first, last)  # from ~ln(32000)+MTP to well below: it learns the text
    assert "corpus: " in r.stdout and "documents" in r.stdout
    assert any(line.startswith("step    30/30 | loss ") for line in r.stdout.splitlines())
    assert "step     1/30 | loss" in r.stdout and "tokens/s" not in r.stdout.split("step     2/30")[0]
    assert "Total TFLOPs" not in r.stdout and "Total TFLOPs" in (out / RUN / "maxtext.log").read_text()


def test_checkpoints_and_tensorboard_are_on_disk(trained):
    out, _ = trained
    found = run_dir.scan(out / RUN / "checkpoints")
    assert found.complete == [0, 10, 20, 29] and not found.partial and not found.damaged
    events = list((out / RUN / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and "learning/loss" in set().union(*(tensorboard_tags(e) for e in events))
    assert (out / RUN / "maxtext.log").stat().st_size > 0


def test_checkpoints_command_lists_the_run(trained):
    out, _ = trained
    r = run_cli("checkpoints", f"base_output_directory={out}")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    states = [line.split()[1] for line in lines if line.strip().startswith("step ") and line.endswith("complete")]
    assert states == ["0", "10", "20", "29"]
    assert "written by recipe 'deepseek3-tiny-cpu'" in r.stdout


def test_rerun_of_a_finished_run_does_nothing(trained):
    out, _ = trained
    r = run_cli("train", "steps=30", "checkpoint_period=10", f"base_output_directory={out}", *SMALL, cwd=out)
    assert r.returncode == 0 and "already trained 30 of 30 steps; nothing to do" in r.stdout


def test_resume_reaches_the_same_loss_as_a_straight_run(tmp_path):
    """N steps + resume + N steps == 2N straight steps.

    The resumed run restores parameters, optimizer state and the Grain iterator position from the
    Orbax checkpoint and compiles the same XLA:CPU program, so it repeats the straight run's
    arithmetic; the tolerance (1e-5 relative) only allows for reduction-order noise, far below the
    ~0.1 that one step of training moves the loss by.
    """
    common = [*SMALL, "learning_rate_schedule_steps=8", "checkpoint_period=4"]
    a, b = tmp_path / "straight", tmp_path / "resumed"
    r = run_cli("train", "steps=8", f"base_output_directory={a}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train", "steps=4", f"base_output_directory={b}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("train", "steps=8", f"base_output_directory={b}", *common)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from step 4" in r.stdout
    straight, resumed = read_metrics(a / RUN), read_metrics(b / RUN)
    assert sorted(resumed) == list(range(8))
    for step in range(4, 8):
        x, y = straight[step]["learning/loss"], resumed[step]["learning/loss"]
        assert abs(x - y) <= 1e-5 * abs(x), (step, x, y)
    assert abs(straight[3]["learning/loss"] - straight[7]["learning/loss"]) > 1e-3  # the loss did move


def _copy(trained, tmp_path):
    out, _ = trained
    dst = tmp_path / "copy"
    shutil.copytree(out, dst)
    return dst


def test_interrupted_saves_are_reported_as_orbax_treats_them(trained, tmp_path):
    """Orbax deletes a leftover `N.orbax-checkpoint-tmp` when it saves step N, and leaves other names alone."""
    out = _copy(trained, tmp_path)
    ckpt = out / RUN / "checkpoints"
    replaced, kept = ckpt / "31.orbax-checkpoint-tmp", ckpt / "30.orbax-checkpoint-tmp-1234"
    shutil.copytree(ckpt / "29", replaced)  # a save cut short before Orbax wrote its metadata
    (replaced / "_CHECKPOINT_METADATA").unlink()
    kept.mkdir()
    r = run_cli("train", "steps=32", "learning_rate_schedule_steps=30", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"ignoring interrupted save {replaced} (Orbax deletes it if this run saves step 31)" in r.stdout
    assert f"ignoring interrupted save {kept} (left in place; delete it once you no longer need it)" in r.stdout
    assert "resuming from step 30" in r.stdout
    assert not replaced.exists() and kept.is_dir() and run_dir.scan(ckpt).latest == 31


def test_more_steps_on_resume_must_say_what_the_schedule_does(trained, tmp_path):
    """Raising steps on resume would restart the cosine for the new total: refused, one line, nothing written."""
    out = _copy(trained, tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = run_cli("train", "steps=40", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "steps: the checkpoints were trained on a 30-step learning-rate schedule, and steps=40" in r.stderr
    assert "add learning_rate_schedule_steps=40" in r.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_damaged_latest_checkpoint_is_refused_without_deleting(trained, tmp_path):
    out = _copy(trained, tmp_path)
    latest = out / RUN / "checkpoints" / "29"
    (latest / "_CHECKPOINT_METADATA").unlink()
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = run_cli("train", "steps=40", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2
    assert f"the latest checkpoint {latest} is unusable: it has no _CHECKPOINT_METADATA" in r.stderr
    assert "move that folder out of" in r.stderr and "to resume from step 20" in r.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    listing = run_cli("checkpoints", f"base_output_directory={out}").stdout
    assert "DAMAGED: it has no _CHECKPOINT_METADATA" in listing
    assert (
        "a re-run stops: the newest checkpoint (step 29) is damaged; move it aside to resume after step 20" in listing
    )


def _largest_chunk(items):
    """(data file, offset, length) of the largest array chunk in an OCDBT checkpoint, from its index."""
    import tensorstore as ts

    kv = ts.KvStore.open(f"file://{items}/").result()
    node = ts.ocdbt.dump(kv, ts.ocdbt.dump(kv).result()["versions"][-1]["root"]["location"]).result()
    assert node["height"] == 0  # the tiny model's index is a single leaf
    refs = [e["indirect_value"].split(":") for e in node["entries"] if "indirect_value" in e]
    _, base, file_id, offset, length = max(refs, key=lambda ref: int(ref[-1]))
    return items / (base + file_id), int(offset), int(length)


def test_random_bytes_in_checkpoint_data_give_one_line_with_the_cause(trained, tmp_path):
    """Bytes overwritten in place (the file keeps its length): Orbax's 82 KB "incompatible handler" error
    becomes one line naming the step, the file's decoding error and the earlier step to resume from."""
    out = _copy(trained, tmp_path)
    ckpt = out / RUN / "checkpoints"
    data, offset, _ = _largest_chunk(ckpt / "29" / "items")
    with data.open("r+b") as f:
        f.seek(offset)
        f.write(os.urandom(64))  # the chunk's zstd frame header
    r = run_cli("train", "steps=32", "learning_rate_schedule_steps=30", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    error = lines[0]
    assert len(error) < 1500, error
    assert error.startswith("maxtext-moe: error: the checkpoint at step 29 cannot be read: ValueError: ")
    assert f'OCDBT database at local file "{ckpt / "29" / "items"}/"' in error and "ZSTD" in error
    assert f"Fix: move {ckpt / '29'} out of {ckpt} to resume from step 20" in error
    assert "Nothing was deleted." in error and run_dir.scan(ckpt).complete == [0, 10, 20, 29]


def test_truncated_checkpoint_data_is_listed_as_damaged_and_refused(trained, tmp_path):
    """A data file cut short (a copy or a disk that filled): found from the OCDBT index, before MaxText starts."""
    out = _copy(trained, tmp_path)
    ckpt = out / RUN / "checkpoints"
    data, offset, length = _largest_chunk(ckpt / "29" / "items")
    os.truncate(data, offset + length // 2)
    listing = run_cli("checkpoints", f"base_output_directory={out}").stdout
    assert f"DAMAGED: its data file {data} is truncated ({offset + length // 2} bytes" in listing
    assert "move it aside to resume after step 20" in listing
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = run_cli("train", "steps=32", "learning_rate_schedule_steps=30", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert f"the latest checkpoint {ckpt / '29'} is unusable: its data file {data} is truncated" in r.stderr
    assert "to resume from step 20" in r.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_a_changed_optimizer_is_refused_before_anything_is_written(trained, tmp_path):
    """opt_type changes the optimizer state's tree, which Orbax cannot restore: refused up front, one line."""
    out = _copy(trained, tmp_path)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    r = run_cli("train", "steps=30", "opt_type=sgd", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert "optimizer state has another structure (opt_type: 'adamw' -> 'sgd')" in r.stderr
    assert "pass --force to set the old checkpoints aside" in r.stderr and "go back to opt_type=adamw" in r.stderr
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    identity = out / RUN / run_dir.IDENTITY  # written before the optimizer was recorded: still resumes
    old = json.loads(identity.read_text())
    identity.write_text(json.dumps({k: v for k, v in old.items() if k != "optimizer"}))
    r = run_cli("train", "steps=30", f"base_output_directory={out}", *SMALL)
    assert r.returncode == 0 and "already trained 30 of 30 steps" in r.stdout, r.stderr[-3000:]
    assert json.loads(identity.read_text())["optimizer"]["opt_type"] == "adamw"


def test_another_recipe_never_overwrites_without_force(trained, tmp_path):
    out = _copy(trained, tmp_path)
    other = [f"base_output_directory={out}", *SMALL, "base_emb_dim=32"]
    r = run_cli("train", "steps=2", *other)
    assert r.returncode == 2
    assert (
        "holds checkpoints of recipe 'deepseek3-tiny-cpu' with another model shape (base_emb_dim: 64 -> 32)" in r.stderr
    )
    assert run_dir.scan(out / RUN / "checkpoints").complete == [0, 10, 20, 29]
    r = run_cli("train", "steps=2", "--force", *other)
    assert r.returncode == 0, r.stderr[-3000:]
    aside = list((out / RUN).glob("checkpoints.set-aside-*"))
    assert len(aside) == 1 and run_dir.scan(aside[0]).complete == [0, 10, 20, 29]
    assert "starting from scratch" in r.stdout


def test_kill_9_resumes_from_the_latest_complete_checkpoint_with_the_same_losses(tmp_path):
    """A hard kill (SIGKILL: the OOM killer, a node lost) of the whole process group: nothing is saved on the way
    out, and the same command resumes from the latest complete checkpoint, taking over the dead run's lock, and
    retrains the lost steps to the same losses."""
    args = [sys.executable, "-m", "maxtext_moe", "train", "steps=400", "checkpoint_period=4"]
    proc = subprocess.Popen(
        [*args, f"base_output_directory={tmp_path}", *SMALL],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True,
    )
    for line in proc.stdout:
        if line.startswith("step    11/400"):
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    metrics = tmp_path / RUN / "metrics.jsonl"
    written = metrics.read_text().splitlines()
    before = {int(m["step"]): m["learning/loss"] for m in map(json.loads, written)}
    saved = run_dir.scan(tmp_path / RUN / "checkpoints").latest
    assert saved is not None and saved < max(before), (saved, sorted(before))  # steps past it were lost
    r = run_cli("train", "steps=12", "learning_rate_schedule_steps=400", f"base_output_directory={tmp_path}", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run lock: taking over" in r.stdout and f"resuming from step {saved + 1}" in r.stdout
    after = [json.loads(x) for x in metrics.read_text().splitlines()][len(written) :]
    again = {int(m["step"]): m["learning/loss"] for m in after}
    assert sorted(again) == list(range(saved + 1, 12))
    overlap = sorted(set(again) & set(before))
    assert overlap and all(again[s] == pytest.approx(before[s], rel=1e-6) for s in overlap), (before, again)


def test_sigterm_checkpoints_the_current_step_and_a_rerun_resumes(tmp_path):
    """A scheduler's SIGTERM mid-run: a checkpoint at the step reached, exit 143, and the same command resumes."""
    args = [
        sys.executable,
        "-m",
        "maxtext_moe",
        "train",
        "steps=400",
        "checkpoint_period=1000",
        f"base_output_directory={tmp_path}",
        *SMALL,
    ]
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1")
    )
    seen = []
    for line in proc.stdout:  # wait until training is under way, then stop it as SLURM would
        seen.append(line)
        if line.startswith("step     6/400"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, "".join(seen) + out + err[-3000:]
    assert "on a termination signal; its checkpoint is saved" in err
    saved = run_dir.scan(tmp_path / RUN / "checkpoints").complete
    assert saved[0] == 0 and len(saved) == 2 and saved[1] >= 6, saved  # step 0 and the step SIGTERM reached
    assert f"stopped after step {saved[1] + 1} of 400" in err
    assert max(read_metrics(tmp_path / RUN)) == saved[1]  # the stopped step's loss is in the metrics too
    assert f"step {saved[1] + 1:>5}/400 | loss" in out
    more = [f"steps={saved[1] + 3}", "learning_rate_schedule_steps=400"]  # the same schedule, fewer steps
    r = run_cli("train", *more, f"base_output_directory={tmp_path}", *SMALL)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from step {saved[1] + 1}" in r.stdout
