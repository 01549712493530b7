"""A small real text corpus, built locally, in the format MaxText's Grain loader reads.

MaxText reads ArrayRecord files of serialized `tf.train.Example`s with a "text" feature, but it
has no way to make them: users are expected to download a dataset. The embedded default must train
on real text without a network, so this module writes such files from text every machine has:
the Python standard library's own source files. The result is reused while its manifest matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError

SOURCES = ("python-stdlib",)
CHUNK_CHARS = 4096  # documents are cut at line ends near this size, so short sequences see varied text
MANIFEST = "manifest.json"


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def _documents(files: list[Path], max_bytes: int) -> Iterator[str]:
    total = 0
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        chunk: list[str] = []
        size = 0
        for line in text.splitlines(keepends=True):
            chunk.append(line)
            size += len(line)
            if size >= CHUNK_CHARS:
                yield "".join(chunk)
                total += size
                chunk, size = [], 0
                if total >= max_bytes:
                    return
        if chunk:
            yield "".join(chunk)
            total += size
            if total >= max_bytes:
                return


def _example(text: str) -> bytes:
    from maxtext.input_pipeline.protos import example_pb2  # protobuf only; does not import jax

    ex = example_pb2.Example()
    ex.features.feature["text"].bytes_list.value.append(text.encode("utf-8"))
    return ex.SerializeToString()


def default_dir(output: Path) -> Path:
    """Where a recipe's corpus lives: shared by every run under one output folder."""
    return output / "corpus"


def file_pattern(out_dir: Path) -> str:
    """The `grain_train_files` pattern for a corpus written to `out_dir`."""
    return str(out_dir / "corpus-*.arrayrecord")


def check(corpus: dict[str, Any], source: str) -> tuple[str, float, int]:
    """(source, max_mib, shards) from a recipe's `corpus` section, or a user error."""
    kind = corpus.get("source")
    if kind not in SOURCES:
        raise UserError(
            f"unknown corpus source {kind!r}.",
            key="corpus.source",
            source=source,
            fix=f"use one of: {', '.join(SOURCES)}.",
        )
    max_mib = corpus.get("max_mib", 8)
    if not isinstance(max_mib, (int, float)) or isinstance(max_mib, bool) or max_mib <= 0:
        raise UserError(f"must be a positive number of MiB, got {max_mib!r}.", key="corpus.max_mib", source=source)
    shards = corpus.get("shards", 1)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise UserError(f"must be a whole number of at least 1, got {shards!r}.", key="corpus.shards", source=source)
    return kind, float(max_mib), shards


def prepare(corpus: dict[str, Any], source: str, out_dir: Path, log: Callable[[str], None] = print) -> str:
    """Build (or reuse) the corpus under `out_dir`; returns the file pattern for `grain_train_files`."""
    kind, max_mib, shards = check(corpus, source)
    files = _stdlib_files()
    wanted = {
        "source": kind,
        "max_mib": max_mib,
        "shards": shards,
        "chunk_chars": CHUNK_CHARS,
        "inputs": hashlib.sha256("\n".join(f"{p}:{p.stat().st_size}" for p in files).encode()).hexdigest()[:16],
    }
    pattern = file_pattern(out_dir)
    manifest = out_dir / MANIFEST
    if manifest.is_file():
        try:
            have = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            have = {}
        if {k: have.get(k) for k in wanted} == wanted:
            log(f"corpus: reusing {have['documents']} documents ({have['mib']:.1f} MiB) in {out_dir}")
            return pattern
    if out_dir.exists() and not manifest.is_file():
        raise UserError(
            f"{out_dir} exists but is not a corpus written by maxtext-moe (no {MANIFEST}).",
            key="corpus",
            source=source,
            fix="move that folder away or choose another base_output_directory.",
        )
    if not files:
        raise UserError(
            f"found no Python source files under {sysconfig.get_paths()['stdlib']}.",
            key="corpus.source",
            source=source,
            fix="use a Python installation that ships its sources.",
        )
    from array_record.python.array_record_module import ArrayRecordWriter

    log(f"corpus: writing {max_mib:g} MiB of Python standard-library source to {out_dir} ...")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    writers = [
        ArrayRecordWriter(str(tmp / f"corpus-{i:05d}-of-{shards:05d}.arrayrecord"), "group_size:1")
        for i in range(shards)
    ]
    count = size = 0
    for count, doc in enumerate(_documents(files, int(max_mib * 2**20)), start=1):
        writers[(count - 1) % shards].write(_example(doc))
        size += len(doc)
    for w in writers:
        w.close()
    (tmp / MANIFEST).write_text(json.dumps(wanted | {"documents": count, "mib": size / 2**20}, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)  # only ever a corpus of ours: a folder without our manifest is refused above
    os.replace(tmp, out_dir)
    log(f"corpus: {count} documents, {size / 2**20:.1f} MiB, {shards} shard(s)")
    return pattern
