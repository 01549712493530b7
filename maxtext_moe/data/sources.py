"""The inputs of `data prepare`: plain text, JSONL and Parquet files, cut into pieces for the workers.

A piece is the unit a worker reads: a whole text file (one document), a line-aligned byte range of
a JSONL file, or one Parquet row group. Pieces are cut and grouped into shards from the files'
sizes alone, so the same inputs always give the same shards: what makes an interrupted run resumable.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from maxtext_moe.errors import UserError

JSONL = (".jsonl", ".json", ".ndjson")
PARQUET = (".parquet",)
JSONL_PIECE = 32 * 2**20  # most bytes of JSONL in one piece; less when that balances the shards better
MIN_PIECE = 4096


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # text | jsonl | parquet
    size: int
    sha256: str


@dataclass(frozen=True)
class Piece:
    source: str
    kind: str
    start: int  # byte offset (jsonl) or row group (parquet)
    end: int
    size: int  # source bytes this piece stands for: the progress bar's unit


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return "jsonl" if suffix in JSONL else "parquet" if suffix in PARQUET else "text"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _expand(inputs: list[Path]) -> list[Path]:
    files: list[Path] = []
    for p in inputs:
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
        else:
            files.append(p)
    return files


def _check_parquet(path: Path, field: str) -> None:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise UserError(f"{path} is not a readable Parquet file ({e}).", key="SRC") from e
    if field not in names:
        raise UserError(
            f"{path} has no column '{field}' (it has: {', '.join(names)}).",
            key="--field",
            fix="name the text column with --field COLUMN.",
        )


def scan(inputs: list[Path], field: str) -> list[Source]:
    """Every input file, checked and hashed; a missing, unreadable or empty one is a user error."""
    files = _expand(inputs)
    if not files:
        raise UserError("no input files.", key="SRC", fix="name text, JSONL or Parquet files or folders.")
    for path in files:
        if not path.is_file() or not os.access(path, os.R_OK):
            raise UserError(f"{path} does not exist or cannot be read.", key="SRC")
        if path.stat().st_size == 0:
            raise UserError(f"{path} is empty.", key="SRC", fix="remove it from the sources.")
        if _kind(path) == "parquet":
            _check_parquet(path, field)
    with ThreadPoolExecutor(min(8, len(files))) as pool:  # hashlib releases the GIL on large blocks
        digests = list(pool.map(sha256, files))
    return [Source(p.resolve(), _kind(p), p.stat().st_size, d) for p, d in zip(files, digests, strict=True)]


def _pieces(s: Source, jsonl_piece: int) -> list[Piece]:
    path = str(s.path)
    if s.kind == "text":
        return [Piece(path, "text", 0, s.size, s.size)]
    if s.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(s.path).metadata
        rows = max(meta.num_rows, 1)
        return [
            Piece(path, "parquet", g, g + 1, s.size * meta.row_group(g).num_rows // rows)
            for g in range(meta.num_row_groups)
        ]
    cuts = [0]
    with s.path.open("rb") as f:
        while cuts[-1] + jsonl_piece < s.size:
            f.seek(cuts[-1] + jsonl_piece)
            f.readline()
            if f.tell() >= s.size:
                break
            cuts.append(f.tell())
    cuts.append(s.size)
    return [Piece(path, "jsonl", a, b, b - a) for a, b in zip(cuts, cuts[1:], strict=False)]


def split(found: list[Source], shards: int) -> list[list[Piece]]:
    """Pieces grouped into at most `shards` contiguous, size-balanced shards (none empty).

    Fewer shards come out only when the pieces are too few or too uneven: a text file is one piece.
    """
    jsonl_piece = min(JSONL_PIECE, max(MIN_PIECE, sum(s.size for s in found) // (4 * shards)))
    pieces = [p for s in found for p in _pieces(s, jsonl_piece)]
    total = max(sum(p.size for p in pieces), 1)
    groups: list[list[Piece]] = [[] for _ in range(shards)]
    seen = 0
    for p in pieces:
        groups[min(seen * shards // total, shards - 1)].append(p)
        seen += p.size
    return [g for g in groups if g]


def documents(piece: Piece, field: str) -> Iterator[str]:
    """The non-blank documents of one piece."""
    if piece.kind == "text":
        try:
            text = Path(piece.source).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            raise UserError(f"{piece.source} cannot be read as UTF-8 text ({e}).", key="SRC") from e
        if text.strip():
            yield text
    elif piece.kind == "parquet":
        import pyarrow.parquet as pq

        for text in pq.ParquetFile(piece.source).read_row_group(piece.start, columns=[field]).column(0).to_pylist():
            if text and text.strip():
                yield text
    else:
        with open(piece.source, "rb") as f:
            f.seek(piece.start)
            while f.tell() < piece.end:
                offset = f.tell()
                line = f.readline()
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[field]
                except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                    raise UserError(
                        f"{piece.source}: the line at byte {offset} is not a JSON object with a '{field}' string.",
                        key="--field" if isinstance(e, KeyError) else "SRC",
                        fix="fix the line, or name the text field with --field.",
                    ) from e
                if isinstance(text, str) and text.strip():
                    yield text
