"""The recipe's XLA flags against the XLA that runs them: a wrong name or value stops `train` before
anything starts, with the key, the file and the fix; the flags the GPU recipes ship are accepted."""

from __future__ import annotations

import pytest
from conftest import run_cli

from maxtext_moe import cli
from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition, xla_flags


@pytest.mark.parametrize("name", [n for n in composition.recipe_names() if cli.resolve(n, []).env.get("XLA_FLAGS")])
def test_every_shipped_recipes_flags_are_known_to_this_xla(name: str) -> None:
    """Read by XLA's own parser (the CPU backend shares it with the GPU one)."""
    xla_flags.check(cli.resolve(name, []))


def test_a_misspelt_flag_names_its_key_and_where_it_was_set() -> None:
    r = cli.resolve("deepseek3-671b-published-gb200-128", ["xla_flags.xla_gpu_enable_latency_hidding_scheduler=true"])
    with pytest.raises(UserError) as e:
        xla_flags.check(r)
    text = str(e.value)
    assert "xla_flags.xla_gpu_enable_latency_hidding_scheduler: XLA (jaxlib 0.11.2) has no such flag." in text
    assert text.startswith("command line: ") and "Fix: correct the name" in text


def test_a_bad_value_names_its_key_and_the_file_that_set_it() -> None:
    r = cli.resolve("deepseek3-671b-published-gb200-128", ["xla_flags.xla_gpu_all_gather_combine_threshold_bytes=lots"])
    with pytest.raises(
        UserError,
        match=r"xla_flags\.xla_gpu_all_gather_combine_threshold_bytes: XLA \(jaxlib "
        r"0\.11\.2\) cannot read the value 'lots'\.",
    ):
        xla_flags.check(r)


def test_train_stops_on_an_unknown_flag_before_anything_starts(tmp_path) -> None:
    r = run_cli("train", "deepseek3-tiny-cpu", f"base_output_directory={tmp_path}", "xla_flags.xla_no_such_flag=1")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("maxtext-moe: error: ") and "xla_flags.xla_no_such_flag: XLA (jaxlib" in lines[-1]
    assert not any(tmp_path.iterdir())  # no run folder, no corpus: nothing was spent
