"""Small `jnp.empty` placeholders lower as constants for GPUs once `placeholder_constants` is installed, large
ones keep XLA's uninitialised allocation, and CPU lowering is untouched. Lowered with `jax.export` for CUDA, which
needs no GPU; whether XLA then merges TE's casts is tests/gpu/test_placeholder_constants_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp

from maxtext_moe.upstream import placeholder_constants

SMALL, LARGE = (1, 1), (64, 4096)  # TE's Hadamard placeholder's shape; a buffer past MAX_ELEMENTS

# Prints how many AllocateBuffer calls each empty lowers to for CUDA, with or without the module installed.
PROBE = f"""
import sys
import jax, jax.numpy as jnp
from maxtext_moe.upstream import placeholder_constants
if sys.argv[1] == "installed":
    placeholder_constants.install()
for shape in [{SMALL!r}, {LARGE!r}]:
    exported = jax.export.export(jax.jit(lambda: jnp.empty(shape, jnp.bfloat16)), platforms=["cuda"])()
    print(exported.mlir_module().count("@AllocateBuffer"))
"""


def allocations(state: str) -> list[int]:
    """Per empty (small, large): AllocateBuffer calls in its CUDA lowering, in a fresh process (the install is
    process-wide)."""
    r = subprocess.run([sys.executable, "-c", PROBE, state], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [int(n) for n in r.stdout.split()]


def test_the_pinned_jax_lowers_every_empty_to_an_allocation_for_gpus() -> None:
    """The gap itself: without the module both placeholders are XLA allocations, which its CSE keeps apart."""
    assert allocations("plain") == [1, 1]


def test_installed_small_empties_are_constants_and_large_ones_allocations() -> None:
    assert allocations("installed") == [0, 1]


def test_cpu_lowering_and_values_are_unchanged() -> None:
    placeholder_constants.install()
    placeholder_constants.install()  # a second install is a no-op
    cpu = jax.export.export(jax.jit(lambda: jnp.empty(SMALL, jnp.bfloat16)), platforms=["cpu"])().mlir_module()
    assert "AllocateBuffer" not in cpu
    assert jnp.empty(LARGE, jnp.float32).shape == LARGE
    assert placeholder_constants.MAX_ELEMENTS < LARGE[0] * LARGE[1]
