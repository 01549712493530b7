"""`upstream.opaque_vjp` on the CPU: the same values and gradients as the function it wraps, and no zero-size
array entering a shard_map inside a differentiated scan, which is what crashes XLA:GPU with TE's grouped GEMM
(docs/UPSTREAM.md; tests/gpu/test_scan_compile_gpu.py compiles it for GPUs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.upstream.opaque_vjp import opaque_vjp

SIZES = jnp.array([3, 5], jnp.int32)


@jax.custom_vjp
def _with_placeholder(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    """A grouped matmul that, as TE's does, keeps a zero-size placeholder among its residuals."""
    return jax.lax.ragged_dot(x, w, sizes)


def _fwd(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes), (x, w, sizes, jnp.zeros((0,), jnp.int32))


def _bwd(res, g):
    x, w, sizes, placeholder = res
    _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes + jnp.sum(placeholder)), x, w)
    return (*vjp(g), None)


_with_placeholder.defvjp(_fwd, _bwd)


def _scanned_step(gemm):
    """value_and_grad of three rematerialised layers, each `gemm` under shard_map inside `jax.lax.scan`."""
    mesh = Mesh(np.array(jax.devices()[:2]), ("expert",))

    def layer(x, w):
        y = jax.shard_map(
            lambda w, x: gemm(x, w, SIZES),
            mesh=mesh,
            in_specs=(P(), P("expert")),
            out_specs=P("expert"),
            check_vma=False,
        )(w, x)
        return jnp.tanh(y), None

    def loss(ws, x):
        x, _ = jax.lax.scan(jax.checkpoint(layer), x, ws)
        return jnp.sum(x**2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _inputs():
    return jax.random.normal(jax.random.key(0), (3, 2, 8, 8)), jax.random.normal(jax.random.key(1), (16, 8))


def _zero_size_shard_map_operands(text: str) -> list[str]:
    """The zero-size operand types of each `sdy.manual_computation` (a shard_map) in lowered StableHLO."""
    found = []
    for line in text.splitlines():
        if "sdy.manual_computation(" in line:
            operands = re.search(r"manual_axes=\{[^}]*\} \((.*)\) \{$", line)
            found += re.findall(r"tensor<0x[^>]*>", operands.group(1) if operands else "")
    return found


def report() -> dict:
    """What the tests check, computed on two CPU devices (a shard_map over one device is not lowered as one).
    The placeholder's step is only lowered here, not compiled: compiled unwrapped, it crashes XLA."""
    ws, x = _inputs()
    (v, (gw, gx)) = _scanned_step(jax.lax.ragged_dot)(ws, x)
    out = {}
    for name, gemm in (("plain", jax.lax.ragged_dot), ("zero_size_residual", _with_placeholder)):
        (v1, (gw1, gx1)) = _scanned_step(opaque_vjp(gemm, 2))(ws, x)
        out[name] = {
            "same_value": float(v) == float(v1),
            "same_gradients": bool(jnp.array_equal(gw, gw1) and jnp.array_equal(gx, gx1)),
            "gradient_nonzero": float(jnp.abs(gw1).sum()) > 0,
            "zero_size_operands": _zero_size_shard_map_operands(_scanned_step(gemm).lower(ws, x).as_text()),
            "zero_size_operands_wrapped": _zero_size_shard_map_operands(
                _scanned_step(opaque_vjp(gemm, 2)).lower(ws, x).as_text()
            ),
        }
    return out


def compile_unwrapped() -> None:
    _scanned_step(_with_placeholder).lower(*_inputs()).compile()


def _child(function: str) -> subprocess.CompletedProcess:
    here = Path(__file__)
    code = (
        f"import json, sys; sys.path.insert(0, {str(here.parent)!r}); "
        f"import {here.stem} as t; print(json.dumps(t.{function}()))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reported() -> dict:
    r = _child("report")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


@pytest.mark.parametrize("name", ["plain", "zero_size_residual"])
def test_same_value_and_gradients_as_the_plain_grouped_matmul(reported: dict, name: str) -> None:
    """Wrapped, both give jax.lax.ragged_dot's loss and gradients exactly (the placeholder adds zero)."""
    r = reported[name]
    assert r["same_value"] and r["same_gradients"] and r["gradient_nonzero"], r


def test_no_zero_size_array_enters_the_shard_map(reported: dict) -> None:
    """The crash's trigger, seen in what JAX hands XLA: partial evaluation of the scan feeds the placeholder
    into the shard_map as an operand; bound as one primitive, the placeholder stays inside."""
    r = reported["zero_size_residual"]
    assert r["zero_size_operands"] == ["tensor<0xi32>"], r
    assert r["zero_size_operands_wrapped"] == [] and reported["plain"]["zero_size_operands"] == []


def test_unwrapped_the_same_step_still_crashes_xla() -> None:
    """The upstream bug `opaque_vjp` works around, in pinned JAX 0.11.2 (on XLA:CPU too). When this fails,
    JAX compiles it: remove `opaque_vjp` and this test (JAX 0.12.0.1 does, docs/UPSTREAM.md)."""
    assert _child("compile_unwrapped").returncode == -11  # SIGSEGV


def _forward_calls(residual_name: str | None, policy_names: tuple[str, ...]) -> tuple[int, jax.Array]:
    """Forward units of an opaque call in the gradient of a checkpointed function, and that gradient."""
    inner = lambda x, w: jnp.sin(x) @ w  # noqa: E731  (its backward reads sin(x) and w)
    call = opaque_vjp(inner, 2, residual_name)
    policy = jax.checkpoint_policies.save_only_these_names(*policy_names)
    x, w = jax.random.normal(jax.random.key(0), (8, 4)), jax.random.normal(jax.random.key(1), (4, 3))
    grad = jax.grad(jax.checkpoint(lambda x, w: jnp.sum(call(x, w) * 0.5), policy=policy), (0, 1))
    calls = str(jax.make_jaxpr(grad)(x, w)).count("maxtext_moe_opaque_call")
    return calls, grad(x, w)


def test_named_residuals_spare_the_backward_a_second_forward() -> None:
    """Names inside the wrapped function are traced only at lowering, where no remat policy sees them: with
    `residual_name` saved by the policy the forward runs once (forward + backward units); without it the
    backward pass runs the forward again."""
    saved, g_saved = _forward_calls("operands", ("operands",))
    unnamed, g_unnamed = _forward_calls(None, ("operands",))
    assert (saved, unnamed) == (2, 3)
    for a, b in zip(g_saved, g_unnamed, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
