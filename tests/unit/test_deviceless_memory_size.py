"""The deviceless compile gets the memory size a GPU's JAX client would give XLA (its allocator's limit)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compiler

from maxtext_moe.upstream import deviceless


def _field_15(value: int) -> bytes:
    """`device_memory_size` (field 15, a varint) as protobuf writes it."""
    return deviceless._varint(15 << 3) + deviceless._varint(value)


def test_memory_size_merges_into_the_options_and_keeps_the_rest() -> None:
    options = compiler.get_compile_options(num_replicas=1, num_partitions=4)
    sized = deviceless.with_memory_size(options, 134 * 2**30)
    assert sized.num_partitions == 4 and sized.num_replicas == 1
    assert _field_15(134 * 2**30) in sized.SerializeAsString()  # jaxlib parsed it and writes it back
    assert _field_15(134 * 2**30) not in options.SerializeAsString()
    resized = deviceless.with_memory_size(sized, 100 * 2**30).SerializeAsString()
    assert _field_15(100 * 2**30) in resized and _field_15(134 * 2**30) not in resized  # the last one wins


def test_every_compile_of_the_process_carries_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through JAX's own compile path: a jitted function compiles with the size in its options and still runs."""
    seen: list[bytes] = []
    compile_and_load = compiler.backend_compile_and_load

    def spy(backend: Any, module: Any, devices: Any, options: Any, callbacks: Any) -> Any:
        seen.append(options.SerializeAsString())
        return compile_and_load(backend, module, devices, options, callbacks)

    monkeypatch.setattr(compiler, "backend_compile_and_load", spy)  # restored, with what wraps it, after the test
    deviceless.pass_memory_size(7 * 2**30)
    out = jax.jit(lambda x: jnp.tanh(x) * 3.0)(np.arange(5.0, dtype=np.float32) + 0.25)
    np.testing.assert_allclose(np.asarray(out), np.tanh(np.arange(5.0) + 0.25) * 3.0, rtol=1e-6)
    assert seen and all(_field_15(7 * 2**30) in s for s in seen)


def test_no_limit_leaves_xlas_own_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler, "backend_compile_and_load", compiler.backend_compile_and_load)
    before = compiler.backend_compile_and_load
    deviceless.pass_memory_size(0)
    assert compiler.backend_compile_and_load is before
