"""The command line as a user meets it: real subprocesses, one readable error line, exit codes."""

from __future__ import annotations

import json

from conftest import run_cli


def test_list_names_the_default_recipe():
    r = run_cli("list")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("deepseek3-tiny-cpu"))
    assert line.endswith("(default)")


def test_show_annotates_sources_and_json_has_all_sections():
    r = run_cli("show", "deepseek3-tiny-cpu", "steps=3")
    assert r.returncode == 0, r.stderr
    assert any(l.split() == ["steps:", "3", "#", "command", "line"] for l in r.stdout.splitlines())
    assert "routed_bias_update_rate:        0.001  # configs/model/deepseek3-tiny.yml" in r.stdout
    data = json.loads(run_cli("show", "deepseek3-tiny-cpu", "--json").stdout)
    assert set(data) >= {"recipe", "maxtext", "env", "topology", "sources", "corpus"}
    assert data["topology"]["num_devices"] == 1


def test_bad_input_to_each_command_is_one_line_and_nonzero(tmp_path):
    cases = [
        (("show", "no-such-recipe"), "no recipe named 'no-such-recipe'"),
        (("show", "deepseek3-tiny-cpu", "num_expert=4"), "Did you mean 'num_experts'?"),
        (("train", "deepseek3-tiny-cpu", "steps=abc", f"base_output_directory={tmp_path}"), "steps: must be an integer"),
        (("train", "megablox=true", f"base_output_directory={tmp_path}"), "megablox: is true, but megablox is a TPU kernel"),
    ]
    for args, text in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = [l for l in r.stderr.splitlines() if l.strip()]
        assert len(lines) == 1 and lines[0].startswith("maxtext-moe: error: ") and text in lines[0], (args, r.stderr)
    assert not any(tmp_path.iterdir()), "a rejected recipe must not create files"


def test_unknown_command_and_missing_argument_are_usage_errors():
    assert run_cli("trian").returncode == 2
    r = run_cli("show")
    assert r.returncode == 2 and "the following arguments are required: recipe" in r.stderr


def test_traceback_flag_shows_the_stack():
    r = run_cli("--traceback", "show", "no-such-recipe")
    assert r.returncode == 2
    assert "Traceback (most recent call last)" in r.stderr and "UserError" in r.stderr
