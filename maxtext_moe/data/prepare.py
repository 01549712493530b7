"""`maxtext-moe data prepare`: tokenize the user's text once into pre-tokenized ArrayRecord shards.

A 671B run must not spend its hosts' CPUs tokenizing on the fly, and its data must be known exact
before thousands of GPU-hours start. This module turns plain text files (one document each), JSONL
(one document per line, a text field) and Parquet (a text column) into ArrayRecord shards of
`tf.train.Example`s whose `text` feature holds int64 token ids: what MaxText's Grain pipeline reads
with `tokenize_train_data: false` (it then neither tokenizes nor adds BOS/EOS, so each record holds
BOS + document + EOS itself; packing happens in MaxText).

Contract of the output folder: shard files appear only whole (written aside, then renamed), each
finished shard is recorded under `.done/`, and `manifest.json` is written last and atomically. A
folder without a manifest is incomplete; a re-run with the same inputs skips finished shards and
yields byte-identical shards and the same manifest. The tokenizer is copied into the folder, so the
corpus carries what MaxText needs to build its tokenizer for padding and decoding.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.data import sources as src
from maxtext_moe.errors import UserError

MANIFEST = "manifest.json"
PLAN = ".plan.json"
DONE = ".done"
TOKENIZER_DIR = "tokenizer"
SHARD_BYTES = 256 * 2**20  # default shard size in source bytes: a few hundred MiB of tokens per file
FORMAT = "maxtext-moe/pretokenized-v1"


def shard_name(i: int, n: int) -> str:
    return f"corpus-{i:05d}-of-{n:05d}.array_record"


def shard_pattern(n: int) -> str:
    """The glob over a corpus's shards, relative to its folder."""
    return f"corpus-*-of-{n:05d}.array_record"


@dataclass(frozen=True)
class Tokenizer:
    """A local Hugging Face tokenizer and the special tokens each record is wrapped in."""

    json_path: Path
    config_path: Path | None
    sha256: str
    bos_id: int | None
    eos_id: int | None
    vocab_size: int


def _special(config: dict[str, Any], name: str) -> str | None:
    token = config.get(name)
    return token.get("content") if isinstance(token, dict) else token


def load_tokenizer(path: Path) -> Tokenizer:
    """Check the `--tokenizer` path (a tokenizer.json or a folder holding one) and read its BOS/EOS ids."""
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.is_file():
        raise UserError(
            f"no tokenizer file at {json_path}.",
            key="--tokenizer",
            fix="pass a Hugging Face tokenizer.json (or the folder holding it), e.g. DeepSeek-V3's.",
        )
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tok = HFTokenizer.from_file(str(json_path))
    except Exception as e:  # noqa: BLE001 - the library raises a bare Exception for a malformed file
        raise UserError(f"{json_path} is not a Hugging Face tokenizer.json ({e}).", key="--tokenizer") from e
    config_path = json_path.with_name("tokenizer_config.json")
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    ids = {}
    for name in ("bos_token", "eos_token"):
        token = _special(config, name)
        ids[name] = tok.token_to_id(token) if token else None
    return Tokenizer(
        json_path=json_path,
        config_path=config_path if config_path.is_file() else None,
        sha256=src.sha256(json_path),
        bos_id=ids["bos_token"],
        eos_id=ids["eos_token"],
        vocab_size=tok.get_vocab_size(),
    )


# ---- worker side: one shard per task ------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, bos: int | None, eos: int | None, report: Any) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    _worker.update(tok=HFTokenizer.from_file(tokenizer_json), bos=bos, eos=eos, report=report)


def _record(ids: list[int]) -> bytes:
    from maxtext.input_pipeline.protos import example_pb2  # protobuf only; does not import jax

    ex = example_pb2.Example()
    ex.features.feature["text"].int64_list.value.extend(ids)
    return ex.SerializeToString()


def _write_shard(task: tuple[int, int, str, list[src.Piece], str]) -> tuple[int, dict[str, list[int]]]:
    """Tokenize one shard's pieces into `out/<shard>`; returns per-source [documents, tokens]."""
    from array_record.python.array_record_module import ArrayRecordWriter

    index, n, out, pieces, field = task
    tok, bos, eos, report = _worker["tok"], _worker["bos"], _worker["eos"], _worker["report"]
    final = Path(out) / shard_name(index, n)
    tmp = Path(out) / DONE / (final.name + ".tmp")
    counts: dict[str, list[int]] = {}
    writer = ArrayRecordWriter(str(tmp), "group_size:1")
    pending = [0, 0, 0]  # bytes, documents, tokens not yet reported
    last = time.monotonic()
    for piece in pieces:
        seen = counts.setdefault(piece.source, [0, 0])
        for text in src.documents(piece, field):
            ids = tok.encode(text, add_special_tokens=False).ids
            ids = ([bos] if bos is not None else []) + ids + ([eos] if eos is not None else [])
            writer.write(_record(ids))
            seen[0] += 1
            seen[1] += len(ids)
            pending[1] += 1
            pending[2] += len(ids)
            if time.monotonic() - last > 0.5:
                report.put((0, pending[1], pending[2]))
                pending[1:] = [0, 0]
                last = time.monotonic()
        pending[0] += piece.size
    writer.close()
    report.put(tuple(pending))
    os.replace(tmp, final)
    _atomic_write(Path(out) / DONE / f"{index:05d}.json", json.dumps(counts))
    return index, counts


# ---- driver -------------------------------------------------------------------------------------


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_same_corpus(out: Path, plan: dict[str, Any]) -> None:
    """A re-run may resume only the corpus it started; anything else in `out` is refused."""
    plan_file = out / PLAN
    if not plan_file.is_file():
        if out.exists() and any(out.iterdir()):
            raise UserError(
                f"{out} is not empty and holds no corpus of `maxtext-moe data prepare`.",
                key="--out",
                fix="choose a new --out folder.",
            )
        return
    have = json.loads(plan_file.read_text())
    differs = [k for k in plan if have.get(k) != plan[k]]
    if differs:
        what = {"sources": "different sources", "tokenizer": "a different tokenizer"}
        named = ", ".join(what.get(k, f"a different {k}") for k in differs)
        raise UserError(
            f"{out} holds another corpus ({named}).",
            key="--out",
            fix="choose a new --out folder (or re-run with the options it was prepared with).",
        )


class _Bar:
    """One `\\r` line on stderr: documents, tokens/s and the time left by source bytes."""

    def __init__(self, total_bytes: int, stream: Any = sys.stderr):
        self.total, self.stream, self.start = max(total_bytes, 1), stream, time.monotonic()
        self.bytes = self.docs = self.tokens = 0

    def add(self, nbytes: int, docs: int, tokens: int) -> None:
        self.bytes, self.docs, self.tokens = self.bytes + nbytes, self.docs + docs, self.tokens + tokens

    def draw(self, final: bool = False) -> None:
        elapsed = max(time.monotonic() - self.start, 1e-6)
        frac = min(self.bytes / self.total, 1.0)
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("nan")
        eta_s = "0s" if final else (f"{eta:.0f}s" if eta == eta else "?")
        line = (
            f"\rprepare {frac:6.1%} | {self.docs:,} documents | {self.tokens:,} tokens | "
            f"{self.tokens / elapsed:,.0f} tokens/s | ETA {eta_s}"
        )
        self.stream.write(line + ("\n" if final else ""))
        self.stream.flush()


def prepare(
    inputs: list[Path],
    tokenizer: Path,
    out: Path,
    shards: int | None = None,
    workers: int | None = None,
    field: str = "text",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Build (or finish, or reuse) the corpus in `out`; returns its manifest."""
    tok = load_tokenizer(tokenizer)
    found = src.scan(inputs, field)
    workers = workers or os.cpu_count() or 1
    total = sum(s.size for s in found)
    n = shards or max(1, -(-total // SHARD_BYTES))
    pieces = src.split(found, n)
    plan = {
        "format": FORMAT,
        "sources": [{"path": str(s.path), "sha256": s.sha256} for s in found],
        "tokenizer": tok.sha256,
        "field": field,
        "shards": len(pieces),
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
    }
    _check_same_corpus(out, plan)
    if (out / MANIFEST).is_file():
        manifest = json.loads((out / MANIFEST).read_text())
        log(f"prepare: {out} is complete ({manifest['documents']:,} documents, {manifest['tokens']:,} tokens)")
        return manifest
    n = len(pieces)
    (out / DONE).mkdir(parents=True, exist_ok=True)
    _atomic_write(out / PLAN, json.dumps(plan, indent=1))
    tok_dir = out / TOKENIZER_DIR
    tok_dir.mkdir(exist_ok=True)
    shutil.copyfile(tok.json_path, tok_dir / "tokenizer.json")
    if tok.config_path is not None:
        shutil.copyfile(tok.config_path, tok_dir / "tokenizer_config.json")
    done = {i for i in range(n) if (out / DONE / f"{i:05d}.json").is_file() and (out / shard_name(i, n)).is_file()}
    todo = [(i, n, str(out), pieces[i], field) for i in range(n) if i not in done]
    if done:
        log(f"prepare: resuming, {len(done)} of {n} shard(s) already written")
    bar = _Bar(sum(p.size for i in range(n) if i not in done for p in pieces[i]))
    ctx = multiprocessing.get_context("spawn")  # the tokenizer's Rust threads must not be forked
    report = ctx.Manager().Queue()
    init = (str(tok.json_path), tok.bos_id, tok.eos_id, report)
    with ctx.Pool(min(workers, max(len(todo), 1)), initializer=_init_worker, initargs=init) as pool:
        result = pool.map_async(_write_shard, todo, chunksize=1)
        while not result.ready():
            _drain(report, bar, timeout=0.2)
            bar.draw()
        result.get()  # re-raises a worker's error
        _drain(report, bar, timeout=0)
    bar.draw(final=True)
    return _finish(out, n, found, tok)


def _drain(report: Any, bar: _Bar, timeout: float) -> None:
    try:
        bar.add(*report.get(timeout=timeout) if timeout else report.get_nowait())
        while True:
            bar.add(*report.get_nowait())
    except queue.Empty:
        pass


def _finish(out: Path, n: int, found: list[src.Source], tok: Tokenizer) -> dict[str, Any]:
    per_source: dict[str, list[int]] = {}
    for i in range(n):
        for path, (docs, tokens) in json.loads((out / DONE / f"{i:05d}.json").read_text()).items():
            acc = per_source.setdefault(path, [0, 0])
            acc[0] += docs
            acc[1] += tokens
    empty = [s.path for s in found if per_source.get(str(s.path), [0, 0])[0] == 0]
    if empty:
        raise UserError(f"{empty[0]} holds no documents.", key="SRC", fix="remove it from the sources.")
    manifest = {
        "format": FORMAT,
        "documents": sum(d for d, _ in per_source.values()),
        "tokens": sum(t for _, t in per_source.values()),
        "shards": n,
        "pattern": shard_pattern(n),
        "column": "text",
        "tokenizer": {
            "sha256": tok.sha256,
            "path": TOKENIZER_DIR,
            "vocab_size": tok.vocab_size,
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
        },
        "sources": [
            {
                "path": str(s.path),
                "kind": s.kind,
                "bytes": s.size,
                "sha256": s.sha256,
                "documents": per_source[str(s.path)][0],
                "tokens": per_source[str(s.path)][1],
            }
            for s in found
        ],
    }
    _atomic_write(out / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def iter_records(out: Path) -> Iterator[list[int]]:
    """Every record's token ids, shard by shard: how tests and users inspect a corpus."""
    from array_record.python.array_record_module import ArrayRecordReader
    from maxtext.input_pipeline.protos import example_pb2

    manifest = json.loads((out / MANIFEST).read_text())
    for i in range(manifest["shards"]):
        reader = ArrayRecordReader(str(out / shard_name(i, manifest["shards"])))
        for raw in reader.read_all():
            yield list(example_pb2.Example.FromString(raw).features.feature["text"].int64_list.value)
        reader.close()
