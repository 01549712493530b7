"""Group alignment for FP8 grouped GEMMs (align.py) and the `fp8` option's plumbing, on the CPU.

The FP8 kernel itself needs TE on a GPU (tests/test_moe_gpu.py); here the padding is checked to leave a
grouped GEMM's result and gradients unchanged, and the TE FP8 call is checked against a stand-in for TE.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jaxpr_eqns

from maxtext_moe.errors import UserError
from maxtext_moe.moe import expert_parallel, gemm
from maxtext_moe.moe.align import align_groups, aligned, compose, pad_rows, padded_rows, take_rows, unpad_rows
from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath

K, N = 8, 5

# (group sizes, rows): empty groups, groups already aligned, one group holding everything, and rows after the
# last group (the expert-parallel receive side sorts its empty slots there).
CASES = [
    ([3, 0, 16, 5, 0, 1], 25),
    ([16, 32, 0, 16], 64),
    ([0, 0, 7, 0], 7),
    ([40], 40),
    ([1, 1, 1, 1, 1], 5),
    ([0, 0, 0], 4),  # every row outside the groups
    ([5, 17, 0, 2], 30),
]


def ragged(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)


def small_ints(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Integers in [-4, 4] as float32: every product and partial sum is exact, so any summation order of
    the padded and unpadded GEMMs (forward and gradients) must give bit-identical results."""
    return jax.random.randint(key, shape, -4, 5).astype(jnp.float32)


@pytest.mark.parametrize("sizes, rows", CASES)
@pytest.mark.parametrize("align", [1, 4, 16])
def test_layout(sizes: list[int], rows: int, align: int) -> None:
    a = align_groups(jnp.array(sizes, jnp.int32), rows, align)
    total = padded_rows(rows, len(sizes), align)
    padded, src, dest = (np.asarray(v) for v in a)
    assert total % align == 0 and total >= rows + len(sizes) * align
    assert src.shape == (total,) and dest.shape == (rows,)
    assert padded.sum() == total and np.all(padded % align == 0)
    # the slack is in the last group only; an empty group gets one block of zero rows
    assert np.all(padded[:-1] == np.maximum(-(-np.array(sizes[:-1]) // align) * align, align))
    inside = np.arange(rows) < sum(sizes)
    assert np.all(dest[~inside] == total)  # rows after the groups are left out
    np.testing.assert_array_equal(src[dest[inside]], np.arange(rows)[inside])  # one-to-one both ways
    assert (src < rows).sum() == inside.sum()
    # each row lands in its own group's padded range
    group_of = np.repeat(np.arange(len(sizes)), sizes)
    padded_start = np.cumsum(padded) - padded
    assert np.all(dest[inside] >= padded_start[group_of]) and np.all(dest[inside] < (padded_start + padded)[group_of])


@pytest.mark.parametrize("sizes, rows", CASES)
def test_pad_unpad_round_trip(sizes: list[int], rows: int) -> None:
    x = jax.random.normal(jax.random.key(0), (rows, K))
    a = align_groups(jnp.array(sizes, jnp.int32), rows, 16)
    xp = pad_rows(x, a)
    assert not np.asarray(xp)[np.asarray(a.src) == rows].any()  # padding rows are zeros
    back = np.asarray(unpad_rows(xp, a))
    inside = np.arange(rows) < sum(sizes)
    np.testing.assert_array_equal(back[inside], np.asarray(x)[inside])
    assert not back[~inside].any()


@pytest.mark.parametrize("sizes, rows", CASES)
@pytest.mark.parametrize("align", [4, 16])
def test_aligned_ragged_dot_equals_unaligned_exactly(sizes: list[int], rows: int, align: int) -> None:
    """Forward and all gradients (x and w) bit-identical, under jit with traced group sizes."""
    kx, kw, kc = jax.random.split(jax.random.key(len(sizes) + rows), 3)
    x, w, cot = small_ints(kx, (rows, K)), small_ints(kw, (len(sizes), K, N)), small_ints(kc, (rows, N))
    sizes = jnp.array(sizes, jnp.int32)

    def loss(gemm_fn, x: jax.Array, w: jax.Array, sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = gemm_fn(x, w, sizes)
        return jnp.sum(y * cot), y

    plain = jax.jit(jax.grad(lambda x, w, s: loss(ragged, x, w, s), (0, 1), has_aux=True))
    padded = jax.jit(
        jax.grad(lambda x, w, s: loss(lambda *a: aligned(ragged, *a, align), x, w, s), (0, 1), has_aux=True)
    )
    (dx, dw), y = plain(x, w, sizes)
    (dx_p, dw_p), y_p = padded(x, w, sizes)
    for got, want in ((y_p, y), (dx_p, dx), (dw_p, dw)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_aligned_ragged_dot_close_on_random_normals() -> None:
    sizes = jnp.array([37, 0, 16, 91, 3, 0, 21], jnp.int32)
    kx, kw = jax.random.split(jax.random.key(1))
    x, w = jax.random.normal(kx, (168, 64)), jax.random.normal(kw, (7, 64, 24))
    f = lambda gemm_fn: jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(gemm_fn(x, w, sizes))), (0, 1)))  # noqa: E731
    v, (dx, dw) = f(ragged)(x, w)
    v_p, (dx_p, dw_p) = f(lambda *a: aligned(ragged, *a, 16))(x, w)
    np.testing.assert_allclose(v_p, v, rtol=1e-6)
    np.testing.assert_allclose(dx_p, dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw_p, dw, rtol=1e-5, atol=1e-5)


def test_padding_gradients_are_gathers() -> None:
    """The backward of pad and unpad gathers by the inverse map: no scatter(-add) in the gradient program."""
    a = align_groups(jnp.array([3, 0, 5]), 8, 16)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(unpad_rows(pad_rows(x, a) * 2.0, a))))(jnp.ones((8, K))))
    assert "gather" in jaxpr and "scatter" not in jaxpr


def test_align_must_be_positive() -> None:
    with pytest.raises(ValueError):
        align_groups(jnp.array([1, 2]), 3, 0)


def fake_te(monkeypatch: pytest.MonkeyPatch, align: int = gemm.FP8_GROUP_ALIGN) -> tuple[types.SimpleNamespace, dict]:
    """Stand-ins for TE's `dense`, `quantize` and `cpp_extensions` modules: grouped_dense enforces what the H200
    enforced for FP8 (every group a multiple of `align` rows, counted in group_sizes, summing to the rows) and
    computes by ragged_dot; create_set records its arguments; grouped_quantize is there for te_group_scales to
    wrap. The layer's backend "te" reaches them."""
    seen: dict = {}

    def check(sizes: np.ndarray, rows: int) -> None:
        assert np.all(sizes % align == 0) and sizes.sum() == rows, (sizes, rows)

    def grouped_dense(x: jax.Array, w: jax.Array, sizes: jax.Array, quantizer_set: object = None) -> jax.Array:
        if quantizer_set is not None:  # FP8: checked when the GEMM runs, under jit too
            seen["quantizer_set"] = quantizer_set
            jax.debug.callback(check, sizes, x.shape[0])
        return ragged(x, w, sizes)

    def create_set(**kwargs: object) -> str:
        seen["create_set"] = kwargs
        return "quantizers"

    quantize = types.SimpleNamespace(
        QuantizerFactory=types.SimpleNamespace(create_set=create_set),
        ScalingMode=types.SimpleNamespace(CURRENT_TENSOR_SCALING="current", MXFP8_1D_SCALING="mxfp8"),
    )
    monkeypatch.setitem(sys.modules, "transformer_engine.jax.quantize", quantize)
    extensions = types.SimpleNamespace(grouped_quantize=lambda *args, **kwargs: None)
    monkeypatch.setitem(sys.modules, "transformer_engine.jax.cpp_extensions", extensions)
    seen["extensions"] = extensions
    dense = types.SimpleNamespace(grouped_dense=grouped_dense)
    monkeypatch.setattr(gemm.te, "import_te", lambda: (dense, None))
    monkeypatch.setattr(gemm, "select_te_grouped_gemm_path", lambda requested="auto": "v1")
    return dense, seen


def test_te_fp8_call_aligns_groups_and_builds_the_quantizer_set(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, seen = fake_te(monkeypatch)
    sizes = jnp.array([5, 0, 16, 17], jnp.int32)
    kx, kw = jax.random.split(jax.random.key(2))
    x, w = small_ints(kx, (38, K)).astype(jnp.bfloat16), small_ints(kw, (4, K, N)).astype(jnp.bfloat16)
    y = gemm._te_fp8(dense, x, w, sizes, "current_scaling", False)
    assert y.dtype == jnp.bfloat16 and y.shape == (38, N)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ragged(x, w, sizes)))
    assert seen["quantizer_set"] == "quantizers"
    assert hasattr(seen["extensions"].grouped_quantize, "wrapped")  # per-group scales without TE's scatters
    assert seen["create_set"] == {
        "scaling_mode": "current",
        "fwd_dtype": jnp.float8_e4m3fn,
        "bwd_dtype": jnp.float8_e5m2,
        "n_groups": 4,
    }


def test_te_mxfp8_call_pads_groups_to_128_rows_with_e4m3_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, seen = fake_te(monkeypatch, align=gemm.MXFP8_GROUP_ALIGN)
    sizes = jnp.array([5, 0, 130, 3], jnp.int32)
    kx, kw = jax.random.split(jax.random.key(3))
    x, w = small_ints(kx, (138, K)).astype(jnp.bfloat16), small_ints(kw, (4, K, N)).astype(jnp.bfloat16)
    y = gemm._te_fp8(dense, x, w, sizes, "mxfp8", False)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ragged(x, w, sizes)))
    assert not hasattr(seen["extensions"].grouped_quantize, "wrapped")  # MXFP8 scales per block: TE's own
    assert seen["create_set"] == {
        "scaling_mode": "mxfp8",
        "fwd_dtype": jnp.float8_e4m3fn,
        "bwd_dtype": jnp.float8_e4m3fn,
        "n_groups": 4,
    }


def test_fp8_modes_agree_with_recipe_choices() -> None:
    from maxtext_moe.moe.settings import CHOICES

    assert CHOICES["fp8"] == gemm.FP8_MODES


CFG = MoEConfig(
    emb_dim=32,
    moe_mlp_dim=16,
    shared_mlp_dim=16,
    routing=RoutingConfig(num_experts=8, top_k=2, n_groups=1, topk_groups=1),
)
FP8 = ExpertPath(fp8="current_scaling")


def test_fp8_reaches_the_grouped_gemm_on_one_device() -> None:
    """`ExpertPath.fp8` is what the layer passes to every grouped GEMM: on a non-TE backend it is refused."""
    params = init_params(jax.random.key(3), CFG, jnp.float32)
    with pytest.raises(UserError, match="TE's grouped GEMM only"):
        moe_forward(params, jnp.ones((4, CFG.emb_dim)), CFG, FP8)


def test_fp8_reaches_the_grouped_gemm_under_expert_parallelism() -> None:
    params = init_params(jax.random.key(4), CFG, jnp.float32)
    with pytest.raises(UserError, match="TE's grouped GEMM only"):
        expert_parallel.ep_moe_forward_emulated(params, jnp.ones((8, CFG.emb_dim)), CFG, 2, FP8)


def test_unknown_fp8_mode_is_a_user_error() -> None:
    with pytest.raises(UserError, match="current_scaling"):
        gemm.grouped_matmul(jnp.ones((4, K)), jnp.ones((2, K, N)), jnp.array([1, 3]), "te", fp8="e4m3")


@pytest.mark.parametrize("kept", [25, 19])
def test_composed_sort_and_padding_equal_the_two_steps(kept: int) -> None:
    """`compose` gathers straight from the unsorted rows into the padded layout and back: the same rows as
    sorting, then padding (a full sort, and a partial one that keeps `kept` of 25 rows)."""
    rows, sizes = 25, jnp.array([3, 0, 9, 5], jnp.int32)  # 17 rows in the groups; the rest sort after them
    x = jax.random.normal(jax.random.key(5), (rows, K))
    order = jax.random.permutation(jax.random.key(6), rows)[:kept].astype(jnp.int32)
    inverse = jnp.full((rows,), kept, jnp.int32).at[order].set(jnp.arange(kept, dtype=jnp.int32))
    a = align_groups(sizes, kept, 16)
    index, back = compose(order, inverse, a)
    two_steps = pad_rows(take_rows(x, order, inverse, True), a)
    np.testing.assert_array_equal(np.asarray(take_rows(x, index, back, True)), np.asarray(two_steps))
    back_two_steps = take_rows(unpad_rows(two_steps, a), inverse, order, True)
    np.testing.assert_array_equal(np.asarray(take_rows(two_steps, back, index, True)), np.asarray(back_two_steps))


def test_fp8_layer_pads_inside_the_sort_with_no_extra_row_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-device layer with FP8 experts through a TE stand-in that enforces 16-row groups: the output and
    gradients of the BF16 path, and as many row gathers (forward and backward): the padding rides on the
    sort's gather and the unpadding on the unsort's, instead of one more gather each way per GEMM."""
    fake_te(monkeypatch)
    params = init_params(jax.random.key(7), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(8), (24, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(9), x.shape)

    def step(path: ExpertPath) -> Callable:
        return jax.value_and_grad(lambda p, x: jnp.sum(moe_forward(p, x, CFG, path)[0] * cot), (0, 1))

    bf16, fp8 = ExpertPath(backend="te"), ExpertPath(backend="te", fp8="current_scaling")
    (v, g), (v8, g8) = jax.jit(step(bf16))(params, x), jax.jit(step(fp8))(params, x)
    np.testing.assert_allclose(v8, v, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(g8), jax.tree.leaves(g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    gathers = [
        sum(e.primitive.name == "gather" and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating) for e in eqns)
        for eqns in (jaxpr_eqns(jax.make_jaxpr(step(p))(params, x).jaxpr) for p in (bf16, fp8))
    ]
    assert gathers[0] > 0 and gathers[1] == gathers[0], gathers
