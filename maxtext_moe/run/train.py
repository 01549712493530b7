"""Run MaxText's pre-training loop for a resolved recipe.

The order is the point: check the recipe's XLA flags against XLA, set the recipe's environment
(XLA_FLAGS and friends are read when jax starts, so nothing here imports jax before this), check that
jax sees the recipe's GPUs, that MaxText's own model accepts the keys and that a checkpoint fits on the disk
(`preflight`), and only then guard the run folder, build the corpus and call MaxText's `train.main` with
exactly those keys.
MaxText's full INFO log and its prints go to `<run>/maxtext.log`; the terminal gets one progress line a step.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.data import corpus, prepared
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import advice, job, maxtext_keys, xla_flags
from maxtext_moe.recipe.resolved import ResolvedRecipe
from maxtext_moe.run import (
    checkpoint_failures,
    distributed,
    divergence,
    interrupt,
    late_errors,
    lock,
    preflight,
    rollback,
    run_dir,
    watchdog,
)
from maxtext_moe.run.guard_counts import GuardCounts
from maxtext_moe.run.progress import Progress, prints_to_log
from maxtext_moe.upstream import maxtext_config, step_hook, stop_metrics


class Stopped(Exception):
    """Training stopped early but cleanly (SIGTERM or Ctrl-C): the latest state is checkpointed."""

    def __init__(self, message: str, status: int = 143):
        super().__init__(message)
        self.status = status  # 128 + the signal that stopped it


@dataclass(frozen=True)
class RunPaths:
    output: Path
    run: Path

    @property
    def metrics(self) -> Path:
        return self.run / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.run / "maxtext.log"


def run_paths(resolved: ResolvedRecipe) -> RunPaths:
    out = Path(str(resolved.maxtext.get("base_output_directory") or "runs")).expanduser().resolve()
    return RunPaths(out, out / str(resolved.maxtext.get("run_name") or resolved.name))


@contextmanager
def _maxtext_logging(log_file: Path, verbose: bool) -> Iterator[None]:
    """Send MaxText's (absl/Python) log to `log_file`; to the terminal only with --verbose.

    Importing MaxText's training module installs its own INFO console handler on the root logger
    and prints a line per optional Google Cloud dependency it stubs out; the import happens here,
    its printing goes to the log file, and handlers that are not ours are silenced. Tracebacks from
    Orbax's background work after a failed restore go there too (`late_errors`).
    """
    chatter = io.StringIO()
    with redirect_stdout(chatter):
        from maxtext.trainers.pre_train import train as _  # noqa: F401  (installs upstream handlers now)

    root = logging.getLogger()
    upstream = [(h, h.level) for h in root.handlers]
    for h, _level in upstream:
        h.setLevel(logging.INFO if verbose else logging.CRITICAL + 1)
    handlers: list[logging.Handler] = [logging.FileHandler(log_file, encoding="utf-8")]
    handlers[0].setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.INFO if verbose else logging.ERROR)
    console.addFilter(lambda record: verbose or not record.exc_info)
    handlers.append(console)
    old_level = root.level
    root.setLevel(logging.INFO)
    for h in handlers:
        root.addHandler(h)
    for line in chatter.getvalue().splitlines():
        logging.getLogger("maxtext-moe").info("MaxText import: %s", line)
    if not verbose:
        late_errors.send_to(log_file)  # not undone: what it catches comes after the run, as the process ends
    try:
        yield
    finally:
        for h in handlers:
            root.removeHandler(h)
            h.close()
        for h, level in upstream:
            h.setLevel(level)
        root.setLevel(old_level)


@contextmanager
def _watched(resolved: ResolvedRecipe, rp: RunPaths, proc: distributed.ProcessSpec) -> Iterator[None]:
    """The heartbeat and hang watchdog of a process of a multi-process job (run/watchdog.py): its launcher
    stops the others and restarts the job when it ends a hung process. A single process runs unwatched."""
    if proc.num_processes == 1:
        yield
        return
    with watchdog.Watchdog(rp.run, proc.process_id, resolved.job_settings) as dog:
        step_hook.install(dog.before_step)
        yield


def _cache(resolved: ResolvedRecipe, rp: RunPaths, proc: distributed.ProcessSpec) -> dict[str, str]:
    """`jax_cache_dir` from `job.compile_cache`; nothing when the recipe sets MaxText's key itself."""
    if "maxtext.jax_cache_dir" in resolved.sources:
        return {}
    cpu = resolved.topology.profile.maxtext_hardware == "cpu"
    default = str(resolved.effective("jax_cache_dir"))
    return {"jax_cache_dir": job.cache_dir(resolved.job_settings, str(rp.run), proc.num_processes, cpu, default)}


def train(
    resolved: ResolvedRecipe,
    *,
    force: bool = False,
    verbose: bool = False,
    out: Callable[[str], None] = print,
    count_upstream_routing: bool = True,
) -> dict | None:
    """Train `resolved` to its `steps`, resuming from the latest checkpoint; returns the last metrics.

    `count_upstream_routing`: with MaxText's own MoE block, re-run its gate and top-k to report the load balance
    (one extra top-k a layer); `bench` turns it off so that MaxText's block is timed as MaxText ships it.
    """
    prepared.require_train_files(
        resolved.maxtext, resolved.sources, resolved.files[-1] if resolved.files else resolved.name
    )
    rp = run_paths(resolved)
    xla_flags.check(resolved)  # XLA would abort the run on a flag it does not know, after the start-up
    os.environ.update(resolved.env)
    # MaxText 0.2.5 looks for its tokenizers under a source checkout's src/maxtext/assets; point it at
    # the installed package's copy so `tokenizer_path: tokenizer.llama2` works from a pip install.
    os.environ.setdefault("MAXTEXT_ASSETS_ROOT", str(maxtext_keys.assets_dir()))
    # MaxText imports transformers for tokenizer and model-config classes; its start-up notices
    # (no PyTorch, RoPE config names) say nothing about this run.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # Several processes: start jax.distributed now, before any device use, so that process 0 alone
    # guards the run folder and writes the corpus while the others wait (distributed.leader_first).
    proc = distributed.initialize(
        resolved.topology, timeout_s=int(resolved.effective("jax_distributed_initialization_timeout"))
    )
    out = out if proc.is_leader else distributed.quiet
    if proc.num_processes > 1 and resolved.guard_settings.action == "rollback":
        raise UserError(
            f"guard.action is rollback, which restarts training inside this process; a job of "
            f"{proc.num_processes} processes cannot do that in step.",
            fix="use guard.action: stop (then run the job again) or skip.",
        )
    expert_parallel = any(resolved.effective(f"{net}_expert_parallelism") != 1 for net in ("ici", "dcn"))
    if warning := distributed.layout_warning(proc, resolved.topology, expert_parallel):
        out(warning)
    for note in advice.notes(resolved):
        out(note)
    # MaxText's config check sets JAX's compilation cache for the process: it must see the run's choice already.
    config = preflight.check(
        resolved,
        dict(resolved.maxtext, base_output_directory=str(rp.output), run_name=rp.run.name) | _cache(resolved, rp, proc),
    )
    with ExitStack() as held:  # process 0 holds the run folder's lock until the run ends
        with distributed.leader_first(proc, "run folder"):
            if proc.is_leader:
                held.enter_context(lock.held(rp.run, log=out))
                found = run_dir.prepare(rp.run, resolved.checkpoint_identity(), force=force, log=out)
            else:
                found = run_dir.scan(rp.run / "checkpoints")
        # Layout resume: a checkpoint of another process count keeps its data position, or one line here.
        from maxtext_moe.run import data_position

        data_position.check(resolved.effective, rp.run / "checkpoints", found, proc, log=out)
        return _run(
            resolved, rp, proc, found, config, verbose=verbose, out=out, count_upstream_routing=count_upstream_routing
        )


def _run(
    resolved: ResolvedRecipe,
    rp: RunPaths,
    proc: distributed.ProcessSpec,
    found: run_dir.Checkpoints,
    config: Any,
    *,
    verbose: bool,
    out: Callable[[str], None],
    count_upstream_routing: bool,
) -> dict | None:
    """Build the corpus and run MaxText (its `config`, checked before anything was written) from the
    checkpoints `found`."""
    steps = int(resolved.effective("steps"))
    start = 0 if found.latest is None else found.latest + 1
    if start >= steps:
        further = (
            "Raise steps=N (with learning_rate_schedule_steps=N)"
            if resolved.training is None
            else "Raise steps=N, up to the training section's length, or training.tokens"
        )
        out(f"{rp.run}: already trained {start} of {steps} steps; nothing to do. {further} to train further.")
        return None
    maxtext = dict(
        resolved.maxtext,
        base_output_directory=str(rp.output),
        run_name=rp.run.name,
        metrics_file=str(rp.metrics) if proc.is_leader else "",  # MaxText appends from every process
    )
    maxtext |= _cache(resolved, rp, proc)
    if resolved.corpus is not None:
        source = resolved.sources.get("corpus.source", resolved.name)
        with distributed.leader_first(proc, "corpus"):
            maxtext["grain_train_files"] = corpus.prepare(
                resolved.corpus, source, corpus.default_dir(rp.output), log=out
            )
    with _maxtext_logging(proc.per_process(rp.log), verbose):
        from maxtext_moe.upstream import balance_metrics, model_patches

        if resolved.moe_settings.ours:  # before MaxText builds the model; after jax.distributed is up (TE probe)
            from maxtext_moe.upstream import deepseek_layer

            deepseek_layer.install(resolved.moe_settings)
        elif count_upstream_routing:
            balance_metrics.install_counted_layer()
        balance_metrics.install()
        if resolved.training_settings is not None:  # after balance_metrics: it wraps the step MaxText defines
            from maxtext_moe.upstream import training_schedule

            training_schedule.install(resolved.training_settings.timeline())
        if resolved.guard_settings.loss_spike is not None:
            from maxtext_moe.upstream import skip_nonfinite

            skip_nonfinite.install()
        model_patches.install(resolved.attention)  # before MaxText builds the model
        out(
            f"{resolved.name}: {config.num_decoder_layers} decoder layers, {resolved.topology.num_devices} device(s) "
            f"of {resolved.topology.hardware}, "
            + (f"resuming from step {start}" if start else "starting from scratch")
            + f", training to step {steps}; checkpoints and TensorBoard in {rp.run}, MaxText log in {rp.log}"
        )
        from maxtext_moe.run import data_position  # layout resume: re-shard a data position on restore

        data_position.install()
        from maxtext.trainers.pre_train import train as maxtext_train

        ckpt_dir = rp.run / "checkpoints"
        lr = resolved.effective("learning_rate")
        counts = GuardCounts(Path(config.tensorboard_dir) / rp.run.name if proc.is_leader else None)
        watcher = divergence.Watcher(resolved.guard_settings, counts)
        while True:  # once, unless guard.action: rollback restarts from the last good checkpoint
            try:
                with (
                    divergence.guard(watcher, rp.metrics, ckpt_dir, steps, lr, enabled=proc.is_leader),
                    prints_to_log(proc.per_process(rp.log), out) as to_terminal,
                    Progress(
                        rp.metrics, steps, out=to_terminal, watch=watcher.see if proc.is_leader else None
                    ) as progress,
                    interrupt.graceful() as interrupts,
                    _watched(resolved, rp, proc),
                ):
                    try:
                        stop_metrics.install()  # each attempt: a stop held by the one before is not this one's
                        maxtext_train.main(maxtext_config.argv(maxtext))
                    except Exception as e:
                        resuming = bool(start) and progress.last is None
                        if known := checkpoint_failures.explain(e, ckpt_dir, found, resuming=resuming, log=rp.log):
                            raise known from e
                        raise
                break
            except rollback.RolledBack as rolled:
                if interrupts.count:  # the user asked to stop: the rollback is prepared for the next run
                    raise Stopped(f"{rolled} Stopped on Ctrl-C instead; run the same command to go on.", 130) from None
                out(f"guard: {rolled}")
                found = run_dir.scan(ckpt_dir)
                start = found.latest + 1
            finally:
                counts.close()
    last = progress.last
    if last is not None and int(last["step"]) + 1 < steps:
        # The stop saves the step in flight and writes its metrics (`stop_metrics`); the checkpoint on disk is
        # the step the run reached and the one a re-run resumes after, should the metrics lag behind it.
        saved = run_dir.scan(ckpt_dir).latest if proc.is_leader else None
        reached = max(int(last["step"]), -1 if saved is None else saved) + 1
        why = "Ctrl-C" if interrupts.count else "a termination signal"
        raise Stopped(
            f"stopped after step {reached} of {steps} on {why}; its checkpoint "
            f"is saved in {ckpt_dir}. Run the same command again to resume.",
            status=130 if interrupts.count else 143,
        )
    return last
