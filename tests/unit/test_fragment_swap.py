"""`data=NAME` / `memory=NAME` on the command line: another fragment in place of the recipe's, with its source."""

from __future__ import annotations

import pytest

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition, maxtext_keys, show

SWAPPED = "configs/data/prepared.yml (data=prepared on the command line)"


def test_swappable_kinds_are_no_maxtext_keys() -> None:
    """A bare `data=` or `memory=` would otherwise be ambiguous with a MaxText key of that name."""
    assert not set(composition.SWAPPABLE) & set(maxtext_keys.defaults())


def test_data_prepared_replaces_the_default_recipes_corpus(prepared_corpus) -> None:
    r = cli.resolve("deepseek3-tiny-cpu", ["data=prepared", f"grain_train_files={prepared_corpus}"])
    assert r.corpus is None  # the python-stdlib fragment and its corpus section are gone
    assert "configs/data/python-stdlib.yml" not in r.files and "configs/data/prepared.yml" in r.files
    assert r.maxtext["tokenize_train_data"] is False
    assert r.sources["maxtext.tokenize_train_data"] == SWAPPED
    assert r.sources["maxtext.learning_rate"] == "recipes/deepseek3-tiny-cpu.yml"  # the recipe's own keys stay
    assert r.maxtext["grain_train_files"].startswith(str(prepared_corpus))
    assert r.maxtext["tokenizer_path"] == str(prepared_corpus / "tokenizer")
    shown = show.render(r)
    assert f'dataset_type:                   "grain"  # {SWAPPED}' in shown


def test_memory_swap_keeps_the_swapped_fragments_own_includes() -> None:
    """offload-moe-up-qv includes offload-moe-up: put in place of minimal-remat, both merge, neither is swapped."""
    r = cli.resolve("deepseek3-proxy-h200-1gpu", ["memory=offload-moe-up-qv"])
    assert r.maxtext["remat_policy"] == "custom" and r.maxtext["moe_mlpwi_0"] == "offload"
    assert r.sources["maxtext.moe_mlpwi_0"] == "configs/memory/offload-moe-up.yml"
    assert (
        r.sources["maxtext.query_proj"]
        == "configs/memory/offload-moe-up-qv.yml (memory=offload-moe-up-qv on the command line)"
    )
    assert "configs/memory/minimal-remat.yml" not in r.files


def test_a_recipe_without_that_kind_gets_the_fragment_after_its_includes() -> None:
    r = cli.resolve("deepseek3-tiny-cpu", ["memory=full-remat"])
    assert r.files[-2:] == ["configs/memory/full-remat.yml", "recipes/deepseek3-tiny-cpu.yml"]
    assert r.sources["maxtext.remat_policy"] == "configs/memory/full-remat.yml (memory=full-remat on the command line)"


def test_an_unknown_fragment_lists_the_choices() -> None:
    with pytest.raises(UserError) as e:
        cli.resolve("deepseek3-tiny-cpu", ["data=prepare"])
    assert str(e.value) == (
        "command line: data: no data fragment 'prepare'. Did you mean 'prepared'? "
        "Fix: use one of: parquet, prepared, python-stdlib, synthetic (configs/data/NAME.yml)."
    )


@pytest.mark.parametrize(
    ("recipe", "why"),
    [
        ("deepseek3-tiny-cpu", "the recipe's corpus section"),
        ("deepseek3-proxy-h200-1gpu", "the recipe reads dataset_type synthetic (configs/data/synthetic.yml)"),
    ],
)
def test_a_corpus_without_the_fragment_that_reads_it_says_to_add_data_prepared(recipe: str, why: str) -> None:
    with pytest.raises(UserError) as e:
        cli.resolve(recipe, ["grain_train_files=/data/corpus"])
    text = str(e.value)
    assert text.startswith(f"command line: grain_train_files: is set, but {why}")
    fix = f"Fix: add data=prepared to read a corpus from `maxtext-moe data prepare` (`maxtext-moe train {recipe} "
    assert fix + "data=prepared grain_train_files=/data/corpus`)" in text


def test_a_missing_corpus_fix_repeats_the_swap() -> None:
    from maxtext_moe.data import prepared

    r = cli.resolve("deepseek3-tiny-cpu", ["data=prepared"])
    with pytest.raises(UserError, match="Fix: maxtext-moe train deepseek3-tiny-cpu data=prepared grain_train_files="):
        prepared.require_train_files(r.maxtext, r.sources, r.files[-1])
