"""Full remat under gradient accumulation: unrolled layers keep the barrier that stops XLA from merging their
recomputation with their forward (maxtext_moe/upstream/remat_cse.py). On the CPU: MaxText's own answer and
the hook's, and what each does to a compiled accumulation loop of checkpointed layers; the 671B compile it
fixes is tests/gpu/test_plan_compile_gpu.py."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import pytest

from maxtext_moe.upstream import remat_cse

LAYERS, ROWS, WIDTH = 4, 8192, 64
ACTIVATION = ROWS * WIDTH * 4  # one float32 activation of a layer


def _config(scan_layers: bool, accumulation: int, hardware: str = "gpu") -> types.SimpleNamespace:
    return types.SimpleNamespace(scan_layers=scan_layers, gradient_accumulation_steps=accumulation, hardware=hardware)


def test_install_keeps_the_barrier_of_unrolled_layers_under_accumulation_on_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maxtext.layers import nnx_decoders
    from maxtext.utils import maxtext_utils

    monkeypatch.setattr(maxtext_utils, "should_prevent_cse_in_remat", maxtext_utils.should_prevent_cse_in_remat)
    # MaxText's own answer: no barrier for scanned layers, and none under accumulation on GPUs.
    assert maxtext_utils.should_prevent_cse_in_remat(_config(False, 20)) is False
    assert maxtext_utils.should_prevent_cse_in_remat(_config(False, 1)) is True
    remat_cse.install()
    remat_cse.install()  # once only
    assert maxtext_utils.should_prevent_cse_in_remat.keeps_barrier_under_accumulation
    assert nnx_decoders.maxtext_utils.should_prevent_cse_in_remat is maxtext_utils.should_prevent_cse_in_remat
    for hardware in ("gpu", "gpu_multiprocess", "cpu"):
        for accumulation in (1, 20):
            assert maxtext_utils.should_prevent_cse_in_remat(_config(False, accumulation, hardware)) is True
            assert maxtext_utils.should_prevent_cse_in_remat(_config(True, accumulation, hardware)) is False


def _layer(w: jax.Array, x: jax.Array) -> jax.Array:
    return x + jnp.tanh(jnp.tanh(x @ w) @ w.T)


def _loss(ws: jax.Array, x: jax.Array, prevent_cse: bool) -> jax.Array:
    for i in range(LAYERS):  # unrolled, each layer checkpointed as MaxText's decoder does (full remat)
        x = jax.checkpoint(_layer, prevent_cse=prevent_cse)(ws[i], x)
    return jnp.sum(x * x)


def _accumulated_grad(ws: jax.Array, xs: jax.Array, prevent_cse: bool) -> jax.Array:
    """MaxText's gradient accumulation: a scan whose body takes the whole gradient of one microbatch."""

    def body(acc: jax.Array, x: jax.Array):
        return acc + jax.grad(_loss)(ws, x, prevent_cse), None

    return jax.lax.scan(body, jnp.zeros_like(ws), xs)[0]


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_without_the_barrier_the_accumulation_loop_keeps_every_layers_activations() -> None:
    ws = jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.float32)
    xs = jax.ShapeDtypeStruct((2, ROWS, WIDTH), jnp.float32)

    def temp(config: types.SimpleNamespace, fn=None) -> int:
        from maxtext.utils import maxtext_utils

        maxtexts_own = maxtext_utils.should_prevent_cse_in_remat
        decide = fn or getattr(maxtexts_own, "__wrapped__", maxtexts_own)  # MaxText's, installed or not
        return _temp_bytes(functools.partial(_accumulated_grad, prevent_cse=decide(config)), ws, xs)

    one_step = _temp_bytes(lambda w, x: jax.grad(_loss)(w, x[0], True), ws, xs)
    maxtexts = temp(_config(False, 2))
    hooks = temp(_config(False, 2), remat_cse.prevent_cse)
    # With the barrier the loop holds what one step holds (and the microbatch it reads); without it, XLA
    # merges each layer's recomputation with its forward and keeps the forward's activations of all layers.
    assert hooks <= one_step + 2 * ACTIVATION, (hooks, one_step)
    assert maxtexts >= hooks + (LAYERS - 1) * ACTIVATION, (maxtexts, hooks)
