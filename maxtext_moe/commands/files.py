"""`data prepare` and `convert`: the files a run reads or writes besides its own folder (corpora, checkpoints)."""

from __future__ import annotations

import argparse
from pathlib import Path

from maxtext_moe.commands import resolve


def cmd_data_prepare(a: argparse.Namespace) -> int:
    from maxtext_moe.data import prepare

    try:
        m = prepare.prepare(
            [Path(p) for p in a.sources], Path(a.tokenizer), Path(a.out), a.shards, a.workers, a.field, log=print
        )
    except KeyboardInterrupt:
        print(f"\nmaxtext-moe: interrupted; finished shards are kept in {a.out}, the same command resumes.")
        return 130
    print(f"{a.out}: {m['documents']:,} documents, {m['tokens']:,} tokens in {m['shards']} shard(s)")
    return 0


def _conversion_interrupted(out: str) -> int:
    """Ctrl-C during a conversion: its output is still under OUT.partial, which the next run replaces."""
    print(f"\nmaxtext-moe: interrupted; nothing was written to {out}, the same command starts again.")
    return 130


def cmd_convert_to_orbax(a: argparse.Namespace) -> int:
    from maxtext_moe.convert import to_orbax

    try:
        to_orbax.convert(Path(a.src), Path(a.out), resolve(a.recipe, a.overrides))
    except KeyboardInterrupt:
        return _conversion_interrupted(a.out)
    return 0


def cmd_convert_to_hf(a: argparse.Namespace) -> int:
    from maxtext_moe.convert import to_hf

    try:
        to_hf.convert(
            Path(a.run_dir), Path(a.out), resolve(a.recipe, a.overrides), a.step, int(a.max_shard_gib * 2**30)
        )
    except KeyboardInterrupt:
        return _conversion_interrupted(a.out)
    return 0
