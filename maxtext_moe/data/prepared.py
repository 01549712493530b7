"""Recipe-time checks of a corpus written by `maxtext-moe data prepare` (no jax, no tokenizer).

A recipe that reads pre-tokenized ArrayRecord shards (data/prepared) cannot fall back to anything:
without `grain_train_files`, or pointed at a folder whose preparation never finished, MaxText would
fail after the devices start, or train on half a corpus. This module refuses both (a missing path when a
run starts, an unfinished folder when the recipe resolves), and turns a corpus folder into its shard
pattern and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition

MANIFEST = "manifest.json"
PREPARE = "maxtext-moe data prepare SRC... --tokenizer PATH --out /data/corpus"


def _reads_prepared(maxtext: dict[str, Any]) -> bool:
    return (
        maxtext.get("dataset_type") == "grain"
        and maxtext.get("grain_file_type", "arrayrecord") == "arrayrecord"
        and maxtext.get("tokenize_train_data") is False
        and not maxtext.get("grain_train_mixture_config_path")
    )


def require_train_files(maxtext: dict[str, Any], sources: dict[str, str], recipe: str) -> None:
    """Refuse to train pre-tokenized data without `grain_train_files`, before anything is written.

    Checked when a run starts, not when the recipe resolves: `show`, `plan`, `list` and `launch` describe a
    recipe before the corpus exists. `recipe` is the recipe's file (`recipes/NAME.yml` or a user's path); the
    fix repeats a `data=prepared` that swapped the recipe's data fragment on the command line.
    """
    if not _reads_prepared(maxtext) or maxtext.get("grain_train_files"):
        return
    ref = Path(recipe).stem if recipe.startswith("recipes/") else recipe
    swap = composition.swap_in(sources.get("maxtext.tokenize_train_data"))
    raise UserError(
        "is not set; this recipe trains on a corpus of yours, prepared once by `maxtext-moe data prepare`.",
        key="grain_train_files",
        source=recipe,
        fix=f"maxtext-moe train {ref} {swap + ' ' if swap else ''}grain_train_files=/data/corpus/*.array_record (a "
        f"folder written by `{PREPARE}`; the folder itself works too).",
    )


def resolve_train_files(maxtext: dict[str, Any], sources: dict[str, str]) -> None:
    """A corpus folder becomes its shard pattern and tokenizer; a folder whose preparation never finished is
    refused. Remote patterns (`gs://`, `hf://`, ...) are left to MaxText: they cannot be checked from here."""
    files = str(maxtext.get("grain_train_files") or "")
    if not _reads_prepared(maxtext) or not files or "://" in files or ";" in files:
        return
    where = sources.get("maxtext.grain_train_files", "the recipe")
    path = Path(files)
    folder = path if path.is_dir() else path.parent
    manifest_file = folder / MANIFEST
    if not manifest_file.is_file():
        raise UserError(
            f"{folder} has no {MANIFEST}: not a corpus of `maxtext-moe data prepare`, or one still being written.",
            key="grain_train_files",
            source=where,
            fix=f"run (or re-run: it resumes) `maxtext-moe data prepare SRC... --tokenizer PATH --out {folder}`.",
        )
    manifest = json.loads(manifest_file.read_text())
    _check_segments(maxtext, manifest, where)
    if path.is_dir():
        maxtext["grain_train_files"] = str(folder / manifest["pattern"])
        sources["maxtext.grain_train_files"] = f"derived from {manifest_file}"
    if not maxtext.get("tokenizer_path"):
        maxtext["tokenizer_path"] = str(folder / manifest["tokenizer"]["path"])
        sources["maxtext.tokenizer_path"] = f"derived from {manifest_file}"


def _check_segments(maxtext: dict[str, Any], manifest: dict[str, Any], where: str) -> None:
    """TE's packed attention (`cudnn_flash_te`) keeps at most `max_segments_per_seq` documents' boundaries per
    row; a corpus whose average document fills a row with more than that would attend across documents."""
    limit = int(maxtext.get("max_segments_per_seq") or 0)
    if maxtext.get("attention") != "cudnn_flash_te" or limit <= 0 or not manifest.get("documents"):
        return
    mean = manifest["tokens"] / manifest["documents"]
    per_row = int(maxtext.get("max_target_length", 0)) / max(mean, 1.0)
    if per_row > limit:
        raise UserError(
            f"is {limit}, but this corpus averages {mean:,.0f} tokens per document, {per_row:,.0f} documents per "
            f"{maxtext.get('max_target_length')}-token row: TE's attention would join the documents past {limit}.",
            key="max_segments_per_seq",
            source=where,
            fix=f"set max_segments_per_seq={2 * int(per_row) + 1} (or more).",
        )
