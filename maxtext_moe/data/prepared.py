"""Recipe-time checks of a corpus written by `maxtext-moe data prepare` (no jax, no tokenizer).

A recipe that reads pre-tokenized ArrayRecord shards (data/prepared) cannot fall back to anything:
without `grain_train_files`, or pointed at a folder whose preparation never finished, MaxText would
fail after the devices start, or train on half a corpus. This module refuses both while the recipe
is resolved, and turns a corpus folder into its shard pattern and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError

MANIFEST = "manifest.json"
PREPARE = "maxtext-moe data prepare SRC... --tokenizer PATH --out /data/corpus"


def _reads_prepared(maxtext: dict[str, Any]) -> bool:
    return (
        maxtext.get("dataset_type") == "grain"
        and maxtext.get("grain_file_type", "arrayrecord") == "arrayrecord"
        and maxtext.get("tokenize_train_data") is False
        and not maxtext.get("grain_train_mixture_config_path")
    )


def resolve_train_files(maxtext: dict[str, Any], sources: dict[str, str], recipe: str) -> None:
    """Require `grain_train_files` for pre-tokenized data; a corpus folder becomes its shards and tokenizer.

    `recipe` is the recipe's file (`recipes/NAME.yml` or a user's path), which the errors name.
    Remote patterns (`gs://`, `hf://`, ...) are left to MaxText: they cannot be checked from here.
    """
    if not _reads_prepared(maxtext):
        return
    where = sources.get("maxtext.grain_train_files", recipe)
    ref = Path(recipe).stem if recipe.startswith("recipes/") else recipe
    files = str(maxtext.get("grain_train_files") or "")
    if not files:
        raise UserError(
            "is not set; this recipe trains on a corpus of yours, prepared once by `maxtext-moe data prepare`.",
            key="grain_train_files",
            source=recipe,
            fix=f"maxtext-moe train {ref} grain_train_files=/data/corpus/*.array_record (a folder written by "
            f"`{PREPARE}`; the folder itself works too).",
        )
    if "://" in files or ";" in files:
        return
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
    if path.is_dir():
        maxtext["grain_train_files"] = str(folder / manifest["pattern"])
        sources["maxtext.grain_train_files"] = f"derived from {manifest_file}"
    if not maxtext.get("tokenizer_path"):
        maxtext["tokenizer_path"] = str(folder / manifest["tokenizer"]["path"])
        sources["maxtext.tokenizer_path"] = f"derived from {manifest_file}"
