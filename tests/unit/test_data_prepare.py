"""`maxtext-moe data prepare` with a real tokenizer trained here, and the recipe check of its corpus."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TEXTS, run_cli

from maxtext_moe.data import prepare
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition, validate


def _decode(tokenizer: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer / "tokenizer.json")).decode(ids, skip_special_tokens=False)


def _jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _paragraphs() -> list[str]:
    return [p for p in TEXTS[2].read_text().split("\n\n") if p.strip()]


def test_text_and_jsonl_become_wrapped_token_records(tokenizer, tmp_path):
    docs = _paragraphs()
    jsonl = _jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "corpus"
    m = prepare.prepare([*TEXTS[:2], jsonl], tokenizer, out, shards=3, workers=2, log=lambda _: None)
    records = list(prepare.iter_records(out))
    assert len(records) == m["documents"] == 2 + len(docs)
    assert sum(len(r) for r in records) == m["tokens"]
    assert all(r[0] == 2 and r[-1] == 3 for r in records)  # <s> ... </s> from tokenizer_config.json
    texts = {_decode(tokenizer, r[1:-1]) for r in records}
    assert {TEXTS[0].read_text(), TEXTS[1].read_text(), *docs} == texts
    assert m["shards"] == 3 and sorted(out.glob(m["pattern"])) == [out / prepare.shard_name(i, 3) for i in range(3)]
    by_path = {s["path"]: s for s in m["sources"]}
    for path in [*TEXTS[:2], jsonl]:
        s = by_path[str(path.resolve())]
        assert s["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and s["bytes"] == path.stat().st_size
    assert by_path[str(jsonl.resolve())]["documents"] == len(docs)
    assert m["tokenizer"]["sha256"] == hashlib.sha256((tokenizer / "tokenizer.json").read_bytes()).hexdigest()
    assert (out / m["tokenizer"]["path"] / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


def test_parquet_text_column(tokenizer, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    docs = _paragraphs()
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "a.parquet", row_group_size=7)
    m = prepare.prepare([tmp_path / "a.parquet"], tokenizer, tmp_path / "out", field="body", log=lambda _: None)
    records = list(prepare.iter_records(tmp_path / "out"))
    assert [_decode(tokenizer, r[1:-1]) for r in records] == docs and m["documents"] == len(docs)
    with pytest.raises(UserError, match=r"a\.parquet has no column 'text' \(it has: body, n\)"):
        prepare.prepare([tmp_path / "a.parquet"], tokenizer, tmp_path / "other", log=lambda _: None)


def test_cli_shows_progress_and_a_rerun_reuses_the_corpus(tokenizer, tmp_path):
    args = ("data", "prepare", *map(str, TEXTS), "--tokenizer", str(tokenizer / "tokenizer.json"), "--out")
    r = run_cli(*args, str(tmp_path / "c"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    bar = r.stderr.split("\r")[-1]
    assert "3 documents" in bar and "tokens/s" in bar and "ETA" in bar
    first = (tmp_path / "c" / "manifest.json").read_text()
    again = run_cli(*args, str(tmp_path / "c"), cwd=REPO)
    assert again.returncode == 0 and "is complete" in again.stdout
    assert (tmp_path / "c" / "manifest.json").read_text() == first


def test_killed_run_resumes_to_the_same_corpus(tokenizer, tmp_path):
    docs = [p for _ in range(40) for p in _paragraphs()]
    jsonl = _jsonl(tmp_path / "big.jsonl", docs)
    files = [*TEXTS, jsonl]
    cmd = [sys.executable, "-m", "maxtext_moe", "data", "prepare", *map(str, files), "--tokenizer", str(tokenizer)]
    cmd += ["--shards", "24", "--workers", "1", "--out"]
    proc = subprocess.Popen([*cmd, str(tmp_path / "c")], cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any((tmp_path / "c" / ".done").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its pool workers and the queue manager
    proc.wait()
    done = len(list((tmp_path / "c" / ".done").glob("*.json")))
    assert 0 < done < 24 and not (tmp_path / "c" / "manifest.json").exists()
    resumed = subprocess.run([*cmd, str(tmp_path / "c")], cwd=REPO, capture_output=True, text=True)
    assert resumed.returncode == 0 and "resuming" in resumed.stdout, resumed.stderr
    whole = subprocess.run([*cmd, str(tmp_path / "w")], cwd=REPO, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr
    assert (tmp_path / "c" / "manifest.json").read_text() == (tmp_path / "w" / "manifest.json").read_text()
    for i in range(24):
        name = prepare.shard_name(i, 24)
        assert (tmp_path / "c" / name).read_bytes() == (tmp_path / "w" / name).read_bytes(), name


def _error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as e:
        prepare.prepare(*args, log=lambda _: None, **kwargs)
    return str(e.value)


def test_user_errors_name_the_file(tokenizer, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    missing = tmp_path / "nope" / "tokenizer.json"
    assert f"--tokenizer: no tokenizer file at {missing}." in _error(TEXTS, missing, tmp_path / "o1")
    assert f"{tmp_path / 'empty.txt'} is empty." in _error([tmp_path / "empty.txt"], tokenizer, tmp_path / "o2")
    assert f"{tmp_path / 'gone.txt'} does not exist" in _error([tmp_path / "gone.txt"], tokenizer, tmp_path / "o3")
    msg = _error([tmp_path / "bad.jsonl"], tokenizer, tmp_path / "o4")
    assert f"{(tmp_path / 'bad.jsonl').resolve()}: the line at byte 17 is not a JSON object with a 'text'" in msg
    assert "is not empty and holds no corpus" in _error(TEXTS, tokenizer, tmp_path / "junk")


def test_an_output_folder_of_another_corpus_is_refused(tokenizer, tmp_path):
    out = tmp_path / "c"
    prepare.prepare(TEXTS[:2], tokenizer, out, log=lambda _: None)
    msg = _error(TEXTS[1:], tokenizer, out)
    assert f"--out: {out} holds another corpus (different sources)." in msg and "Fix: choose a new --out" in msg
    other = tmp_path / "tok2"
    other.mkdir()
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    data["model"]["vocab"]["zz-extra"] = len(data["model"]["vocab"])
    (other / "tokenizer.json").write_text(json.dumps(data))
    assert "holds another corpus (a different tokenizer, a different bos_id, a different eos_id)" in _error(
        TEXTS[:2], other, out
    )


# ---- the recipe side: data/prepared needs a finished corpus --------------------------------------

RECIPE = """include: [base/maxtext-moe, model/deepseek3-tiny, hardware/cpu, parallelism/single-device, data/prepared]
maxtext: {steps: 3}
"""


def _resolve(path: Path, *overrides: str):
    return validate.resolve(composition.compose(str(path), list(overrides)))


def test_prepared_fragment_requires_a_finished_corpus(tokenizer, recipe_file, tmp_path):
    path = recipe_file(RECIPE)
    assert _resolve(path).maxtext.get("grain_train_files") in (None, "")  # show, plan and launch work without it
    r = run_cli("train", str(path), f"base_output_directory={tmp_path / 'runs'}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"maxtext-moe: error: {path}: grain_train_files: is not set;")
    assert f"Fix: maxtext-moe train {path} grain_train_files=/data/corpus/*.array_record" in r.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything is written
    half = tmp_path / "half"
    (half / ".done").mkdir(parents=True)
    with pytest.raises(UserError, match=f"command line: grain_train_files: {half} has no manifest.json"):
        _resolve(path, f"grain_train_files={half}")
    with pytest.raises(UserError, match=f"{half} has no manifest.json"):
        _resolve(path, f"grain_train_files={half}/*.array_record")


def test_a_corpus_folder_resolves_to_its_shards_and_tokenizer(tokenizer, recipe_file, tmp_path):
    out = tmp_path / "corpus"
    m = prepare.prepare(TEXTS, tokenizer, out, shards=2, log=lambda _: None)
    r = _resolve(recipe_file(RECIPE), f"grain_train_files={out}")
    assert r.maxtext["grain_train_files"] == str(out / m["pattern"])
    assert r.maxtext["tokenizer_path"] == str(out / "tokenizer")
    assert r.sources["maxtext.grain_train_files"] == f"derived from {out / 'manifest.json'}"
    pattern = _resolve(recipe_file(RECIPE), f"grain_train_files={out}/*.array_record")
    assert pattern.maxtext["grain_train_files"] == f"{out}/*.array_record"


def test_packed_te_attention_needs_room_for_the_corpus_documents(tokenizer, tmp_path):
    """Short documents pack many to a row; TE's attention keeps `max_segments_per_seq` of them apart."""
    from maxtext_moe.data import prepared

    out = tmp_path / "corpus"
    m = prepare.prepare(TEXTS, tokenizer, out, shards=1, log=lambda _: None)
    seq = 10 * m["tokens"] // m["documents"]  # about ten of these documents to a row
    per_row = seq / (m["tokens"] / m["documents"])
    keys = {"dataset_type": "grain", "tokenize_train_data": False, "attention": "cudnn_flash_te"}
    keys |= {"max_target_length": seq, "grain_train_files": str(out)}
    with pytest.raises(UserError, match=r"max_segments_per_seq: is 2, but this corpus averages") as e:
        prepared.resolve_train_files(dict(keys, max_segments_per_seq=2), {})
    assert f"set max_segments_per_seq={2 * int(per_row) + 1}" in str(e.value)
    fits = dict(keys, max_segments_per_seq=2 * int(per_row) + 1)
    prepared.resolve_train_files(fits, {})
    assert fits["grain_train_files"] == str(out / m["pattern"])
