"""The dropless MoE layer against a dense per-expert reference and MaxText's own block; TE path switch."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel

from maxtext_moe.errors import UserError
from maxtext_moe.moe import gemm
from maxtext_moe.moe.layer import MoEConfig, fuse_up, init_params, moe_forward, sort_by_expert
from maxtext_moe.moe.reference import moe_reference
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath

CFG = MoEConfig(
    emb_dim=64,
    moe_mlp_dim=32,
    shared_mlp_dim=32,
    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
)


@pytest.mark.parametrize("backend", ["ragged_dot", "tokamax"])
@pytest.mark.parametrize("seed", [0, 1])
def test_layer_matches_dense_reference(backend: str, seed: int) -> None:
    params = init_params(jax.random.key(seed), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(100 + seed), (3, 40, CFG.emb_dim))
    y, routing = jax.jit(moe_forward, static_argnums=(2, 3))(params, x, CFG, ExpertPath(backend=backend))
    assert y.shape == x.shape and int(routing.counts.sum()) == 3 * 40 * 4
    assert rel(y, moe_reference(params, x, CFG)) < 1e-5


def test_bf16_layer_close_to_float32_reference() -> None:
    params = init_params(jax.random.key(2), CFG, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(3), (128, CFG.emb_dim), jnp.bfloat16)
    y, _ = jax.jit(moe_forward, static_argnums=(2, 3))(params, x, CFG, ExpertPath())
    assert y.dtype == jnp.bfloat16 and rel(y, moe_reference(params, x, CFG)) < 2e-2


def test_gradients_match_reference_and_are_finite() -> None:
    params = init_params(jax.random.key(4), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (64, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(6), x.shape)
    loss = lambda p, x: jnp.sum(moe_forward(p, x, CFG, ExpertPath())[0] * cot)  # noqa: E731
    loss_ref = lambda p, x: jnp.sum(moe_reference(p, x, CFG) * cot)  # noqa: E731
    g, g_ref = jax.jit(jax.grad(loss, (0, 1)))(params, x), jax.jit(jax.grad(loss_ref, (0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_ref), strict=True):
        assert np.isfinite(np.asarray(a)).all(), path
        if "bias" in jax.tree_util.keystr(path):
            assert not np.asarray(a).any()  # the bias is updated outside the optimizer
        else:
            assert rel(a, b) < 1e-4, path


def fused(params: dict) -> dict:
    """The same layer in MaxText's `prefuse_moe_weights` tree: one `wi` for wi_0 and wi_1."""
    return {**params, "MoeBlock_0": fuse_up(params["MoeBlock_0"])}


def test_fused_up_weights_are_the_same_layer() -> None:
    """One `wi` [E, D, 2F] holds wi_0 then wi_1: the layer's output is unchanged, and wi's gradient is wi_0's
    and wi_1's side by side (so AdamW moves the same weights)."""
    params = init_params(jax.random.key(4), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (64, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(6), x.shape)
    loss = lambda p, x: jnp.sum(moe_forward(p, x, CFG, ExpertPath())[0] * cot)  # noqa: E731
    fp = fused(params)
    assert set(fp["MoeBlock_0"]) == {"gate", "wi", "wo"}
    assert fp["MoeBlock_0"]["wi"].shape == (16, CFG.emb_dim, 2 * CFG.moe_mlp_dim)
    np.testing.assert_array_equal(moe_forward(fp, x, CFG)[0], moe_forward(params, x, CFG)[0])
    assert rel(moe_forward(fp, x, CFG)[0], moe_reference(fp, x, CFG)) < 1e-5
    g, g_fused = jax.jit(jax.grad(loss))(params, x), jax.jit(jax.grad(loss))(fp, x)
    np.testing.assert_array_equal(g_fused["MoeBlock_0"]["wi"], fuse_up(g["MoeBlock_0"])["wi"])
    np.testing.assert_array_equal(g_fused["MoeBlock_0"]["wo"], g["MoeBlock_0"]["wo"])


def test_dropless_check_rejects_out_of_range_experts() -> None:
    good = jnp.array([[0, 3], [1, 2]], jnp.int32)
    _, _, sizes = sort_by_expert(good, 4)
    assert int(sizes.sum()) == 4
    bad = jnp.array([[0, 4], [1, 2]], jnp.int32)  # expert 4 does not exist: a copy would be dropped
    with pytest.raises(UserError, match="not dropless"):
        sort_by_expert(bad, 4)
    with pytest.raises(Exception, match="not dropless"):
        jax.jit(lambda i: sort_by_expert(i, 4)[2])(bad).block_until_ready()


def test_sort_unsort_round_trip() -> None:
    idx = jax.random.randint(jax.random.key(7), (50, 3), 0, 8)
    order, inverse, sizes = sort_by_expert(idx, 8)
    flat = np.asarray(idx).reshape(-1)
    assert np.all(np.diff(flat[np.asarray(order)]) >= 0)
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(inverse)], np.arange(150))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=8))


def test_same_function_as_maxtext_block() -> None:
    """MaxText's RoutedAndSharedMoE (sparse_matmul, ragged_dot) on our parameters gives our output."""
    from maxtext_moe.upstream.maxtext_block import maxtext_moe_fn

    params = init_params(jax.random.key(8), CFG, jnp.float32)
    params["MoeBlock_0"]["gate"]["bias"] = params["MoeBlock_0"]["gate"]["bias"].at[3].set(1.0)
    x = jax.random.normal(jax.random.key(9), (2, 16, CFG.emb_dim))
    fn, state = maxtext_moe_fn(CFG, params, batch=2, seq=16, dtype="float32", use_tokamax_gmm=False)
    y, _ = moe_forward(params, x, CFG, ExpertPath())
    assert rel(y, jax.jit(fn)(state, x)) < 1e-5


@pytest.mark.parametrize(
    "runtime, compiled, requested, want",
    [
        (130100, True, "auto", "v1"),  # the lent H200 image: TE built with V2, cuBLAS 13.1 at run time
        (130400, True, "auto", "v2"),
        (130500, False, "auto", "v1"),  # TE built without V2
        (130500, True, "v1", "v1"),
        (130400, True, "v2", "v2"),
    ],
)
def test_te_grouped_gemm_path_decision(runtime: int, compiled: bool, requested: str, want: str) -> None:
    assert gemm.te_grouped_gemm_path(runtime, compiled, requested) == want


@pytest.mark.parametrize("runtime, compiled, requested", [(130100, True, "v2"), (130500, True, "fast")])
def test_te_grouped_gemm_path_refusals(runtime: int, compiled: bool, requested: str) -> None:
    with pytest.raises(UserError):
        gemm.te_grouped_gemm_path(runtime, compiled, requested)


def test_te_backend_without_te_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_te(name: str, *args, **kwargs):
        if name.startswith("transformer_engine"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_te)
    x, w = jnp.ones((4, 8)), jnp.ones((2, 8, 3))
    with pytest.raises(UserError, match="transformer-engine"):
        gemm.grouped_matmul(x, w, jnp.array([1, 3]), "te")


def test_unknown_backend_is_a_user_error() -> None:
    with pytest.raises(UserError, match="ragged_dot"):
        gemm.grouped_matmul(jnp.ones((4, 8)), jnp.ones((2, 8, 3)), jnp.array([1, 3]), "cutlass")


def _unwritten_tail_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes, **_) -> jax.Array:
    """Stand-in for tokamax's Mosaic GPU kernel as seen on two H200s: output rows past the groups, and the
    same rows of the input gradient, are left unwritten (NaN here)."""
    sizes = group_sizes.value

    @jax.custom_vjp
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        tail = jnp.arange(x.shape[0]) >= jnp.sum(sizes)
        return jnp.where(tail[:, None], jnp.nan, jax.lax.ragged_dot(x, w, sizes))

    def fwd(x, w):
        return f(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        _, vjp = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)
        dx, dw = vjp(g)
        return jnp.where((jnp.arange(x.shape[0]) >= jnp.sum(sizes))[:, None], jnp.nan, dx), dw

    f.defvjp(fwd, bwd)
    return f(lhs, rhs)


def test_partial_groups_give_zero_tail_rows_and_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The expert-parallel receive buffer has rows past the groups; whatever the kernel leaves there, the
    grouped GEMM returns zeros and passes zero gradient for them, as jax.lax.ragged_dot does."""
    import tokamax

    monkeypatch.setattr(tokamax, "ragged_dot", _unwritten_tail_ragged_dot)
    x = jax.random.normal(jax.random.key(0), (12, 8))
    w = jax.random.normal(jax.random.key(1), (3, 8, 5))
    sizes = jnp.array([2, 0, 5])  # 7 of 12 rows

    def loss(x, w, backend, partial):
        return jnp.sum(jnp.sin(gemm.grouped_matmul(x, w, sizes, backend, partial=partial)))

    assert np.isnan(np.asarray(jax.grad(loss)(x, w, "tokamax", False))).any()  # the stand-in does bite
    out = gemm.grouped_matmul(x, w, sizes, "tokamax", partial=True)
    ref = jax.lax.ragged_dot(x, w, sizes)
    assert np.array_equal(np.asarray(out[7:]), np.zeros((5, 5)))
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
    grad = jax.grad(loss, argnums=(0, 1))
    for got, want in zip(grad(x, w, "tokamax", True), grad(x, w, "ragged_dot", False), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_minimal_remat_recomputes_no_grouped_gemm() -> None:
    """Under MaxText's own `remat_policy: minimal` the backward pass reruns none of the expert GEMMs (full
    remat reruns both: wi_0 and wi_1 as one, and wo): the outputs carry the names that policy saves."""
    from maxtext.layers import nnx_decoders

    params = init_params(jax.random.key(4), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (64, CFG.emb_dim))
    loss = lambda p, x: jnp.sum(moe_forward(p, x, CFG, ExpertPath())[0] ** 2)  # noqa: E731

    def grouped_gemms(policy: object) -> int:
        f = loss if policy == "no remat" else jax.checkpoint(loss, policy=policy)
        return str(jax.make_jaxpr(jax.value_and_grad(f))(params, x)).count("ragged_dot_general")

    without_remat = grouped_gemms("no remat")
    assert grouped_gemms(nnx_decoders.NNXDecoder.minimal_policy(None)) == without_remat
    assert grouped_gemms(None) == without_remat + 2


@pytest.mark.parametrize("where", ["device", "offload"])
def test_policies_keep_the_up_projection_output_whole(where: str) -> None:
    """wi_0 and wi_1 run as one GEMM: a policy that keeps their outputs (MaxText's `minimal` on the device, the
    published policy's `moe_mlpwi_0/1: offload` in host memory) keeps that GEMM's output as one residual, not its
    two halves, which XLA would copy out of it every step."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals is its only public form
    from maxtext.layers import nnx_decoders

    policy = {
        "device": nnx_decoders.NNXDecoder.minimal_policy(None),
        "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["moe_mlpwi_0", "moe_mlpwi_1"],
            offload_src="device",
            offload_dst="pinned_host",
        ),
    }[where]
    cfg = dataclasses.replace(CFG, moe_mlp_dim=24)  # no other tensor has 24 or 48 columns
    params = init_params(jax.random.key(4), cfg, jnp.float32)
    x = jax.random.normal(jax.random.key(5), (64, cfg.emb_dim))
    loss = lambda p, x: jnp.sum(moe_forward(p, x, cfg, ExpertPath())[0] ** 2)  # noqa: E731
    routed = x.shape[0] * cfg.routing.top_k
    up = [
        str(aval)
        for aval, _ in saved_residuals(jax.checkpoint(loss, policy=policy), params, x)
        if aval.ndim == 2 and aval.shape[-1] in (24, 48)
    ]
    assert up == [f"float32{'<host>' if where == 'offload' else ''}[{routed},48]"]
