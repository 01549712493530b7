"""Shared helpers: run the real CLI in a subprocess, write recipe files, read run outputs."""

from __future__ import annotations

import importlib
import json
import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from maxtext_moe.run import progress

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXTS = [STDLIB / "json" / "encoder.py", STDLIB / "json" / "decoder.py", STDLIB / "textwrap.py"]

# Small enough for a few seconds per step on 2 cores, big enough that loss moves.
FAST = ["per_device_batch_size=2", "max_target_length=128", "log_period=5"]


def benchmark(name: str) -> ModuleType:
    """A script of benchmarks/ as a module. The folder is no package (its scripts import each other by name, as
    `python benchmarks/X.py` finds them), so it is on sys.path for the import alone."""
    folder = str(REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files that declare a longer time limit (`pytest.mark.timeout`) first. scripts/test.sh hands whole files to
    its workers in collection order, and the file of whole SLURM jobs, started last, ran alone at the end."""

    def limit(item: pytest.Item) -> float:
        mark = item.get_closest_marker("timeout")
        return -float(mark.args[0]) if mark and mark.args else 0.0

    items.sort(key=limit)


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


def run_processes(n: int, *args: str, timeout: int = 400) -> list[subprocess.CompletedProcess]:
    """`python -m maxtext_moe ARGS` as processes 0..n-1 of one job on loopback, as a launcher starts them."""
    from maxtext_moe.run.distributed import free_port

    port = free_port()
    procs = []
    for pid in range(n):
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            JAX_NUM_PROCESSES=str(n),
            JAX_PROCESS_ID=str(pid),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "maxtext_moe", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


def one_accumulation_step(recipe: str, *overrides: str) -> list[str]:
    """`overrides` and a batch of one accumulation step. The 671B compile records are of one step of the
    per-device batch (gradient_accumulation_steps 1), while the training section accumulates to the paper's
    batch, which adds the accumulated gradients (plan/memory.py) to the step."""
    from maxtext_moe import cli

    r = cli.resolve(recipe, list(overrides))
    per_step = r.training_settings.batch_end // r.training_settings.accumulation
    return [*overrides, f"training.batch_start={per_step}", f"training.batch_end={per_step}"]


def recorded_scheduler_limit(compiled: dict, device_memory: int):
    """The scheduler budget a recorded compile (the "compiled" of `plan --compile --json`) ran to, with the slop
    factor of its flags: from the allocator's limit where `plan --compile` passed it (the record keeps the
    allocator's settings), from XLA's 80% where the record is of a compile without it."""
    from maxtext_moe.plan import scheduler_limit

    env = compiled.get("allocator_env")
    passed = 0 if env is None else scheduler_limit.allocator_bytes(device_memory, env)
    return scheduler_limit.of(compiled["memory"], device_memory, compiled.get("xla_flags", ""), passed)


def compile_without_gpu(*args: str) -> dict:
    """`plan ARGS --compile --json` with no GPU visible: the deviceless route where JAX's CUDA plugin is
    installed (the GPU tests' compiles for GPUs that are not there)."""
    r = subprocess.run(
        [sys.executable, "-m", "maxtext_moe", "plan", *args, "--compile", "--json"],
        cwd=REPO,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Step -> MaxText's scalars from the run's metrics file (a resumed run appends)."""
    return progress.read_metrics(run_dir / "metrics.jsonl")


def tensorboard_scalars(event_file: Path) -> dict[str, dict[int, float]]:
    """Tag -> step -> value of the scalars in a TensorBoard event file, parsed from its TFRecord framing
    with tensorboardX's protobufs (TensorBoard's own reader is not installed)."""
    from tensorboardX.proto import event_pb2

    data = event_file.read_bytes()
    scalars: dict[str, dict[int, float]] = {}
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        for v in event.summary.value:
            scalars.setdefault(v.tag, {})[event.step] = v.simple_value
        pos += 12 + length + 4
    return scalars


def tensorboard_tags(event_file: Path) -> set[str]:
    """Scalar tags in a TensorBoard event file."""
    return set(tensorboard_scalars(event_file))


def rel(a, b) -> float:
    """Relative L2 error of `a` against the reference `b`, in float64 (arrays of any kind numpy can read)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def recipe_file(tmp_path):
    """Write a recipe YAML under tmp_path and return its path."""

    def write(text: str, name: str = "my-recipe.yml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained on a few KB of real text, saved as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXTS[0].read_text()[:8000]], trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="session")
def prepared_corpus(tokenizer, tmp_path_factory) -> Path:
    """A real corpus folder written by `data prepare` (what the 671B recipes' grain_train_files names)."""
    from maxtext_moe.data import prepare

    out = tmp_path_factory.mktemp("corpus") / "corpus"
    prepare.prepare(TEXTS, tokenizer, out, shards=1, log=lambda _: None)
    return out


def with_corpus(recipe_maxtext: dict, overrides: list[str], corpus: Path) -> list[str]:
    """`overrides` plus the corpus for a recipe that reads prepared data (data/prepared), as a user runs it."""
    if recipe_maxtext.get("tokenize_train_data") is False and recipe_maxtext.get("dataset_type") == "grain":
        return [*overrides, f"grain_train_files={corpus}"]
    return overrides


def jaxpr_eqns(jaxpr) -> list:
    """Every equation of a jaxpr, those of nested jaxprs (jit, custom_vjp, checkpoint) once per call."""
    import jax.extend.core as jcore

    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    eqns += jaxpr_eqns(getattr(sub, "jaxpr", sub))
    return eqns
