"""`python -m maxtext_moe.plan.peak`: the buffers alive at XLA's memory peak, from a real XLA:CPU dump."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from maxtext_moe.errors import UserError
from maxtext_moe.plan.peak import find_peak


def held(x: jax.Array) -> jax.Array:
    """`a` (tanh of a product) stays alive while `b` is made and used: both are alive at the peak."""
    a = jnp.tanh(x @ x.T)
    b = jnp.sin(x @ x) @ x.T
    return jnp.sum(a * b) + jnp.sum(a)


def dump(tmp_path: Path) -> Path:
    x = jnp.ones((1024, 1024), jnp.float32)
    options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_held"}
    compiled = jax.jit(held).lower(x).compile(options)
    assert compiled.memory_analysis().temp_size_in_bytes > 0
    return tmp_path


def test_the_peak_names_the_buffers_alive_there_by_shape_and_op(tmp_path: Path) -> None:
    peak = find_peak(dump(tmp_path), module="jit_held")
    assert 0 <= peak.position < peak.of and peak.instruction
    assert peak.bytes == sum(g.bytes for g in peak.groups)
    assert [g.bytes for g in peak.groups] == sorted((g.bytes for g in peak.groups), reverse=True)
    four_mib = [g for g in peak.groups if g.shape == "f32[1024,1024]"]
    assert sum(g.bytes for g in four_mib) >= 2 * 2**22  # the input and `a` at least
    assert any("tanh" in g.op_name for g in four_mib), peak.render()


def test_the_module_runs_as_a_command_and_a_missing_dump_is_one_line(tmp_path: Path) -> None:
    folder = dump(tmp_path / "dump")
    r = subprocess.run(
        [sys.executable, "-m", "maxtext_moe.plan.peak", str(folder), "--module", "jit_held", "--top", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.startswith("peak: ") and "more groups" in r.stdout, r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "maxtext_moe.plan.peak", str(tmp_path / "empty")], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "xla_dump_to" in r.stderr
    with pytest.raises(UserError, match="no buffer assignment"):
        find_peak(tmp_path / "empty")
