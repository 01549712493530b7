"""The `maxtext-moe` command line.

Every user-facing failure is a `UserError`: printed as one line `maxtext-moe: error: ...` with
exit status 2. `--traceback` shows the full stack for those and for everything else.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from maxtext_moe import __version__
from maxtext_moe.commands import DEFAULT_RECIPE, files, planning, recipes, resolve, runs
from maxtext_moe.errors import UserError, brief, root_cause
from maxtext_moe.upstream import maxtext_errors

__all__ = ["main", "parser", "resolve"]  # resolve: a recipe as every command reads it, for tests and scripts


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="maxtext-moe", description="DeepSeek-V3 MoE training recipes on MaxText.")
    p.add_argument("--version", action="version", version=f"maxtext-moe {__version__}")
    p.add_argument("--traceback", action="store_true", help="show the full Python traceback on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser(
        "train",
        help="train a recipe (default: the tiny CPU DeepSeek-V3)",
        description=f"Train RECIPE (default {DEFAULT_RECIPE}), resuming from its latest checkpoint.",
    )
    t.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]", help="recipe name or .yml path, then overrides")
    t.add_argument(
        "--force",
        action="store_true",
        help="if the run folder holds another recipe's checkpoints, set them aside (renamed) and start fresh",
    )
    t.add_argument("--verbose", action="store_true", help="stream MaxText's full log to the terminal")
    t.set_defaults(func=runs.cmd_train)

    s = sub.add_parser("show", help="print the resolved configuration with where each value came from")
    s.add_argument("recipe", help="recipe name or .yml path")
    s.add_argument("overrides", nargs="*", metavar="key=value")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=recipes.cmd_show)

    pl = sub.add_parser("plan", help="memory, FLOPs, communication and step time per GPU, before launch")
    pl.add_argument("recipe", help="recipe name or .yml path")
    pl.add_argument("overrides", nargs="*", metavar="key=value")
    pl.add_argument("--gpus", type=int, help="plan for this many GPUs (FSDP absorbs the change)")
    pl.add_argument("--gpu-type", help="plan for this hardware profile (h100, h200, gb200, gb300)")
    pl.add_argument("--search", action="store_true", help="rank layouts (FSDP x EP x PP, batch, remat) that fit")
    pl.add_argument(
        "--compile",
        action="store_true",
        help="also compile the real training step for the full device count (mock GPU topology, or XLA:CPU "
        "devices without a GPU) and set XLA's per-device memory beside the plan",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(func=planning.cmd_plan)

    d = sub.add_parser("doctor", help="what the recipe needs (GPU, TE, NCCL, FP8) against what this machine has")
    d.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]", help="recipe name or .yml path, then overrides")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=planning.cmd_doctor)

    la = sub.add_parser(
        "launch",
        help="print the SLURM batch script or Kubernetes Job that trains RECIPE on N nodes",
        description="Print the job for RECIPE on --nodes N, after the planner has checked that it fits.",
    )
    la.add_argument("recipe", help="recipe name or .yml path")
    la.add_argument("overrides", nargs="*", metavar="key=value")
    target = la.add_mutually_exclusive_group(required=True)
    target.add_argument("--slurm", action="store_true", help="sbatch script: pyxis/enroot container, one task per GPU")
    target.add_argument(
        "--k8s", action="store_true", help="indexed Job + headless coordinator Service, one pod per node"
    )
    la.add_argument("--nodes", type=int, required=True, help="number of nodes (sets topology.nodes)")
    la.add_argument("--image", help="container image (default: what scripts/build_container.sh produces)")
    la.add_argument("--time", default="04:00:00", help="SLURM time limit (default %(default)s)")
    la.add_argument(
        "--runtime",
        choices=("pyxis", "podman", "venv"),
        default="pyxis",
        help="SLURM: how each task runs: a pyxis/enroot container (default), `podman run`, or a Python "
        "environment every node mounts (--venv)",
    )
    la.add_argument("--venv", help="--runtime venv: the environment's folder (default: the one running this)")
    la.add_argument(
        "--max-restarts",
        type=int,
        help="restarts in place after a lost or hung process: in the allocation (SLURM), in the pods (Kubernetes); "
        "default: the recipe's job.max_restarts",
    )
    la.add_argument("--tasks-per-node", type=int, help="CPU recipes: processes per node (default 1)")
    la.add_argument(
        "--warning",
        type=int,
        help="SLURM: seconds before the time limit to finish the step, checkpoint and stop (default 2400: a step "
        "and a save of the 671B recipe)",
    )
    la.add_argument(
        "--skip-fit-check",
        action="store_true",
        help="print the job even when the planner's memory estimate says it does not fit (it is an "
        "estimate; docs/PLAN.md gives its measured error)",
    )
    la.set_defaults(func=planning.cmd_launch)

    b = sub.add_parser("bench", help="time warm-up + N real training steps and report them against the plan")
    b.add_argument("recipe", help="recipe name or .yml path")
    b.add_argument("overrides", nargs="*", metavar="key=value")
    b.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    b.add_argument("--warmup", type=int, default=3, help="untimed steps first: compilation, autotuning (default 3)")
    b.add_argument("--profile", action="store_true", help="trace warm-up steps 1-2: device time by stage of the step")
    b.add_argument("--json", action="store_true", help="machine-readable output")
    b.add_argument("--out", help="also write the JSON result to this file")
    b.set_defaults(func=runs.cmd_bench)

    rp = sub.add_parser("report", help="one line: what ended a job's last attempt, and the checkpoint it resumes from")
    rp.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]", help=f"as for train (default {DEFAULT_RECIPE})")
    rp.set_defaults(func=runs.cmd_report)

    c = sub.add_parser("checkpoints", help="list a run's Orbax checkpoints, their state and what a re-run resumes from")
    c.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]", help=f"as for train (default {DEFAULT_RECIPE})")
    c.set_defaults(func=runs.cmd_checkpoints)

    da = sub.add_parser("data", help="prepare a corpus of your own text for training")
    dp = da.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND").add_parser(
        "prepare",
        help="tokenize text/JSONL/Parquet files into pre-tokenized ArrayRecord shards (resumable)",
        description="Tokenize SRC files (or folders) into ArrayRecord shards in --out; manifest.json is written last.",
    )
    dp.add_argument("sources", nargs="+", metavar="SRC", help="text files (one document each), .jsonl, .parquet")
    dp.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json, or the folder holding it")
    dp.add_argument("--out", required=True, help="the corpus folder (re-run the same command to resume)")
    dp.add_argument("--shards", type=int, help="number of shard files, at most (default: one per 256 MiB of input)")
    dp.add_argument("--workers", type=int, help="tokenizing processes (default: all cores)")
    dp.add_argument("--field", default="text", help="JSONL field / Parquet column with the text (default %(default)s)")
    dp.set_defaults(func=files.cmd_data_prepare)

    cv = sub.add_parser("convert", help="Hugging Face DeepSeek-V3 checkpoints <-> Orbax, in bounded memory")
    cvs = cv.add_subparsers(dest="convert_command", required=True, metavar="SUBCOMMAND")
    ho = cvs.add_parser(
        "hf-to-orbax",
        help="a Hugging Face checkpoint (FP8 or BF16) -> the Orbax folder `train ... load_parameters_path=OUT` loads",
        description="Stream SRC (config.json, safetensors shards, index) into OUT, in the layout RECIPE's model "
        "trains from; FP8 weights are dequantized, the MTP layer and the router's bias kept. One tensor is read "
        "and written at a time: peak host memory is the process's baseline plus 3x the largest tensor in float32 "
        "plus 48 MiB, whatever the model's size (measured; docs/CONVERT.md). Written under OUT.partial and renamed "
        "when complete; re-run to restart.",
    )
    ho.add_argument("src", metavar="SRC", help="the Hugging Face checkpoint folder")
    ho.add_argument("out", metavar="OUT", help="the Orbax folder to write (must not exist)")
    ho.add_argument("--recipe", required=True, help="the recipe whose model the checkpoint is for")
    ho.add_argument("overrides", nargs="*", metavar="key=value")
    ho.set_defaults(func=files.cmd_convert_to_orbax)
    oh = cvs.add_parser(
        "orbax-to-hf",
        help="a run's Orbax checkpoint (or an hf-to-orbax folder) -> BF16 safetensors, index and config.json",
        description="Stream the parameters of RUN_DIR's latest (or --step N) checkpoint, or of a folder hf-to-orbax "
        "wrote, into OUT as Hugging Face DeepSeek-V3 safetensors in BF16 (the router's bias in float32), with an "
        "index and a config.json that transformers loads. The optimizer state is never read. One tensor is read "
        "and written at a time: peak host memory is the process's baseline plus 3x the largest tensor in float32 "
        "plus 48 MiB, and the stored chunk that holds it (measured; docs/CONVERT.md). Written under OUT.partial "
        "and renamed when complete; re-run to restart.",
    )
    oh.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (runs/RECIPE) or a folder hf-to-orbax wrote")
    oh.add_argument("out", metavar="OUT", help="the Hugging Face folder to write (must not exist)")
    oh.add_argument("--recipe", required=True, help="the recipe whose model the checkpoint holds")
    oh.add_argument("--step", type=int, help="the checkpoint step to convert (default: the latest complete one)")
    oh.add_argument("--max-shard-gib", type=float, default=5.0, help="largest safetensors shard (default 5 GiB)")
    oh.add_argument("overrides", nargs="*", metavar="key=value")
    oh.set_defaults(func=files.cmd_convert_to_hf)

    ls = sub.add_parser("list", help="list the recipes")
    ls.set_defaults(func=recipes.cmd_list)
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, letting `key=value` overrides stand after options too (`train --force steps=9`)."""
    p = parser()
    args, extra = p.parse_known_args(argv)
    words = [w for w in extra if "=" in w and not w.startswith("-")]
    target = next((getattr(args, n) for n in ("overrides", "args") if isinstance(getattr(args, n, None), list)), None)
    rest = [w for w in extra if w not in words] if target is not None else extra
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if target is not None:
        target.extend(words)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except UserError as e:
        if args.traceback:
            traceback.print_exc()
        print(f"maxtext-moe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "maxtext-moe: interrupted; the latest complete checkpoint is kept and a re-run resumes from it.",
            file=sys.stderr,
        )
        return 130
    except Exception as e:  # noqa: BLE001 - a bug or an upstream failure: one line unless --traceback
        if args.traceback:  # printed here: a run sends uncaught errors to its log (run/late_errors.py)
            traceback.print_exc()
            return 1
        shown = maxtext_errors.underlying(e)
        if isinstance(shown, UserError):
            print(f"maxtext-moe: error: {shown}", file=sys.stderr)
            return 2
        cause = root_cause(shown)
        why = "" if cause is shown else f"; cause: {brief(cause)}"
        print(f"maxtext-moe: error: {brief(shown)}{why} (run with --traceback for details)", file=sys.stderr)
        return 1
