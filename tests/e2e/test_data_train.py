"""Your own data end to end: `data prepare` writes a corpus, and the tiny DeepSeek-V3 learns from it.

The recipe is deepseek3-tiny-cpu's fragments with data/prepared in place of data/python-stdlib: the
same model, reading pre-tokenized shards through MaxText's Grain loader (tokenize_train_data: false)
with the tokenizer that `data prepare` copied into the corpus folder.
"""

from __future__ import annotations

import json
import statistics
import sysconfig
from pathlib import Path

import pytest
from conftest import FAST, REPO, read_metrics, run_cli

pytestmark = pytest.mark.slow
STDLIB = Path(sysconfig.get_paths()["stdlib"])
RECIPE = """include:
  - base/maxtext-moe
  - model/deepseek3-tiny
  - hardware/cpu
  - parallelism/single-device
  - data/prepared
  - checkpoint/frequent
maxtext: {learning_rate: 0.002, warmup_steps_fraction: 0.05}
"""


def _tokenizer(folder: Path) -> Path:
    """A real byte-level BPE tokenizer, trained here on a few KB of Python source."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<pad>", "<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([(STDLIB / "textwrap.py").read_text()], trainer)
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_prepared_corpus_trains_the_tiny_model(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": p.read_text()}) + "\n" for p in sorted((STDLIB / "json").glob("*.py"))))
    corpus = tmp_path / "corpus"
    r = run_cli(
        "data", "prepare", str(STDLIB / "textwrap.py"), str(docs), "--tokenizer", str(tok), "--out", str(corpus)
    )
    assert r.returncode == 0, r.stderr
    assert json.loads((corpus / "manifest.json").read_text())["tokens"] > 20_000

    recipe = tmp_path / "own-data.yml"
    recipe.write_text(RECIPE)
    out = tmp_path / "runs"
    args = ("train", str(recipe), f"grain_train_files={corpus}", f"base_output_directory={out}", "steps=30")
    r = run_cli(*args, *FAST, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = read_metrics(out / "own-data")
    assert sorted(metrics) == list(range(30))
    first = statistics.mean(metrics[s]["learning/loss"] for s in range(5))
    last = statistics.mean(metrics[s]["learning/loss"] for s in range(25, 30))
    assert last < first - 1.0, (first, last)


def test_the_default_recipe_trains_on_a_prepared_corpus_without_a_recipe_file(tokenizer, tmp_path):
    """`data=prepared` swaps the default recipe's data fragment from the command line: no YAML of one's own."""
    corpus = tmp_path / "corpus"
    r = run_cli("data", "prepare", str(STDLIB / "textwrap.py"), "--tokenizer", str(tokenizer), "--out", str(corpus))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "runs"
    args = ("train", "data=prepared", f"grain_train_files={corpus}", f"base_output_directory={out}", "steps=3")
    r = run_cli(*args, *FAST, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(read_metrics(out / "deepseek3-tiny-cpu")) == [0, 1, 2]
    assert not (out / "corpus").exists()  # the python-stdlib corpus the recipe names was never written
