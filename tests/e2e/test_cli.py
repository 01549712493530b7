"""The command line as a user meets it: real subprocesses, one readable error line, exit codes."""

from __future__ import annotations

import json

from conftest import run_cli


def test_list_puts_each_recipe_on_its_cluster_and_names_the_default():
    r = run_cli("list")
    assert r.returncode == 0, r.stderr
    rows = {line.split()[3]: line.split() for line in r.stdout.splitlines()[1:] if " x " in line[:14]}
    assert rows["deepseek3-tiny-cpu"][:5] == ["1", "x", "cpu", "deepseek3-tiny-cpu", "(default)"]
    assert rows["deepseek3-671b-h200-128"][:3] == ["128", "x", "h200"]
    assert rows["deepseek3-671b-h100-256"][:3] == ["256", "x", "h100"]
    assert rows["deepseek3-proxy-h200-2gpu"][:3] == ["2", "x", "h200"]
    assert "plan RECIPE --gpus N" in r.stdout


def test_show_annotates_sources_and_json_has_all_sections():
    r = run_cli("show", "deepseek3-tiny-cpu", "steps=3")
    assert r.returncode == 0, r.stderr
    assert any(line.split() == ["steps:", "3", "#", "command", "line"] for line in r.stdout.splitlines())
    assert "routed_bias_update_rate:        0.001  # configs/model/deepseek3-tiny.yml" in r.stdout
    data = json.loads(run_cli("show", "deepseek3-tiny-cpu", "--json").stdout)
    assert set(data) >= {"recipe", "maxtext", "env", "topology", "sources", "corpus"}
    assert data["topology"]["num_devices"] == 1


def test_bad_input_to_each_command_is_one_line_and_nonzero(tmp_path):
    cases = [
        (("show", "no-such-recipe"), "no recipe named 'no-such-recipe'"),
        (("show", "deepseek3-tiny-cpu", "num_expert=4"), "Did you mean 'num_experts'?"),
        (
            ("train", "deepseek3-tiny-cpu", "steps=abc", f"base_output_directory={tmp_path}"),
            "steps: must be an integer",
        ),
        (
            ("train", "megablox=true", f"base_output_directory={tmp_path}"),
            "megablox: is true, but megablox is a TPU kernel",
        ),
    ]
    for args, text in cases:
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
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


def test_an_error_inside_a_context_that_yields_twice_is_reported_itself(monkeypatch, capsys):
    """On GPUs MaxText runs its loop inside a context manager that catches and yields again; contextlib then
    raises "generator didn't stop after throw()". The CLI reports the error that started it (an out-of-memory
    seen on two H200s), and our own errors keep their one-line form."""
    import argparse
    import contextlib

    from maxtext_moe import cli
    from maxtext_moe.errors import UserError

    @contextlib.contextmanager
    def yields_twice():  # the shape of maxtext.utils.max_utils.transformer_engine_context
        try:
            yield
        except Exception:
            yield

    def failing(error: Exception):
        def run(_args):
            with yields_twice():
                raise error

        return run

    for error, status, line in (
        (
            MemoryError("RESOURCE_EXHAUSTED: Out of memory"),
            1,
            "maxtext-moe: error: MemoryError: RESOURCE_EXHAUSTED: Out of memory",
        ),
        (
            UserError("EP receive buffer overflow", key="ragged_buffer_factor"),
            2,
            "maxtext-moe: error: ragged_buffer_factor: EP receive buffer overflow",
        ),
    ):
        monkeypatch.setattr(cli, "_parse", lambda argv, e=error: argparse.Namespace(func=failing(e), traceback=False))
        assert cli.main([]) == status
        err = capsys.readouterr().err
        assert err.startswith(line) and "generator" not in err
