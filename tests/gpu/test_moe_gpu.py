"""Each GPU grouped-GEMM backend inside the layer against the float32 dense reference (needs a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import benchmark, rel

from maxtext_moe.moe.layer import MoEConfig, fuse_up, init_params, moe_forward
from maxtext_moe.moe.reference import moe_reference
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU"),
]

CFG = MoEConfig(
    emb_dim=512,
    moe_mlp_dim=256,
    shared_mlp_dim=256,
    routing=RoutingConfig(num_experts=32, top_k=8, n_groups=8, topk_groups=4),
)
BF16_TOL = (2e-2, 2e-2)  # (forward, dL/dx), relative L2 error
# FP8 current scaling on the routed experts only (E4M3 operands forward: 3 mantissa bits; E5M2 gradients: 2);
# the shared expert and the router stay BF16/float32. A CPU emulation of per-tensor current scaling on this
# exact layer and input (quantize-dequantize around jax.lax.ragged_dot) gave 4.3e-2 forward and 6.2e-2 for
# dL/dx: the E5M2 gradient costs the most. Bounds with headroom over that, far below what a wrong scale or
# wrong padding gives (order 1).
FP8_TOL = (6e-2, 1e-1)


def check_against_reference(
    cfg: MoEConfig, path: ExpertPath, tol: tuple[float, float], forward: Callable = moe_forward
) -> np.ndarray:
    """Forward and dL/dx of the BF16 layer (`forward(params, x, cfg, path)`) within `tol` (relative L2) of the
    float32 reference, all finite; returns the expert group sizes the layer ran with."""
    params = init_params(jax.random.key(0), cfg, jnp.bfloat16)
    x = jax.random.normal(jax.random.key(1), (1024, cfg.emb_dim), jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    loss = lambda x: jnp.sum(forward(params, x, cfg, path)[0].astype(jnp.float32) * cot)  # noqa: E731
    loss_ref = lambda x: jnp.sum(moe_reference(params, x, cfg) * cot)  # noqa: E731
    y, routing = jax.jit(forward, static_argnums=(2, 3))(params, x, cfg, path)
    dx, dx_ref = jax.jit(jax.grad(loss))(x), jax.jit(jax.grad(loss_ref))(x.astype(jnp.float32))
    assert np.isfinite(np.asarray(y, np.float32)).all() and np.isfinite(np.asarray(dx, np.float32)).all()
    assert rel(y, moe_reference(params, x, cfg)) < tol[0]
    assert rel(dx, dx_ref) < tol[1]
    return np.asarray(routing.counts)


@pytest.mark.parametrize("backend", ["ragged_dot", "tokamax", "te"])
def test_backend_forward_and_grad_close_to_reference(backend: str) -> None:
    check_against_reference(CFG, ExpertPath(backend=backend), BF16_TOL)


@pytest.mark.parametrize("fp8", ["none", "current_scaling"])
def test_te_on_the_fused_up_weights_gives_what_it_gives_unfused(fp8: str) -> None:
    """MaxText's `prefuse_moe_weights` tree (one `wi`) on TE's grouped GEMM: the same output and gradients as
    wi_0 and wi_1 concatenated in the step (one FP8 scale for both either way)."""
    params = init_params(jax.random.key(0), CFG, jnp.bfloat16)
    fused = {**params, "MoeBlock_0": fuse_up(params["MoeBlock_0"])}
    x = jax.random.normal(jax.random.key(1), (1024, CFG.emb_dim), jnp.bfloat16)
    path = ExpertPath(backend="te", fp8=fp8)
    loss = lambda p, x: jnp.sum(moe_forward(p, x, CFG, path)[0].astype(jnp.float32) ** 2)  # noqa: E731
    g, g_fused = jax.jit(jax.grad(loss, (0, 1)))(params, x), jax.jit(jax.grad(loss, (0, 1)))(fused, x)
    np.testing.assert_array_equal(np.asarray(g_fused[1], np.float32), np.asarray(g[1], np.float32))
    want = fuse_up(g[0]["MoeBlock_0"])["wi"]
    np.testing.assert_array_equal(np.asarray(g_fused[0]["MoeBlock_0"]["wi"], np.float32), np.asarray(want, np.float32))
    assert float(jnp.abs(want.astype(jnp.float32)).max()) > 0


def test_te_fp8_current_scaling_close_to_reference() -> None:
    """TE's FP8 grouped GEMM with current scaling on unaligned expert groups (random routing: about 256 rows
    per expert, not multiples of 16), padded to 16 rows per group by `align.py`."""
    sizes = check_against_reference(CFG, ExpertPath(backend="te", fp8="current_scaling"), FP8_TOL)
    assert np.any(sizes % 16), "the groups happened to be aligned: the padding went untested"


def test_te_fp8_gemm_with_an_empty_expert_group_close_to_reference() -> None:
    """An expert that receives no rows leaves every other expert its own weight scale: the experts' weights
    differ in magnitude by 4x each, so a GEMM that ran with a neighbour's FP8 scale would be off by 4x (TE's
    per-group FP8 GEMM does that after an empty group; `align.py` leaves no group empty)."""
    from maxtext_moe.moe import gemm

    sizes = jnp.array([60, 0, 100, 96], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (256, 256), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (4, 256, 128)) * 4.0 ** jnp.arange(4)[:, None, None]).astype(jnp.bfloat16)
    cot = jax.random.normal(jax.random.key(2), (256, 128), jnp.float32)
    fp8 = lambda x: gemm.grouped_matmul(x, w, sizes, "te", fp8="current_scaling")  # noqa: E731
    exact = lambda x: jax.lax.ragged_dot(x, w.astype(jnp.float32), sizes)  # noqa: E731
    y, ref = jax.jit(fp8)(x), exact(x.astype(jnp.float32))
    dx = jax.jit(jax.grad(lambda x: jnp.sum(fp8(x).astype(jnp.float32) * cot)))(x)
    dx_ref = jax.grad(lambda x: jnp.sum(exact(x) * cot))(x.astype(jnp.float32))
    ends = np.cumsum(np.asarray(sizes))
    for g, (start, end) in enumerate(zip(ends - np.asarray(sizes), ends, strict=True)):
        if end > start:
            assert rel(y[start:end], ref[start:end]) < FP8_TOL[0], f"expert {g}, forward"
            assert rel(dx[start:end], dx_ref[start:end]) < FP8_TOL[1], f"expert {g}, dL/dx"


@pytest.mark.parametrize("chunks", [1, 2])
def test_te_under_the_expert_parallel_dispatch_in_chunks(chunks: int) -> None:
    """TE's grouped GEMM inside the expert-parallel path training runs (shard_map, the dense all-to-all), on a
    one-GPU expert axis, in one dispatch or two chunks (`moe.dispatch_chunks`): each chunk's receive buffer
    is sized for the dropless worst case and mostly empty, its rows past the groups guarded."""
    from jax.sharding import Mesh

    from maxtext_moe.moe import expert_parallel
    from maxtext_moe.moe.settings import EP_AXIS

    mesh = Mesh(np.array(jax.devices()[:1]), (EP_AXIS,))

    def forward(params: dict, x: jax.Array, cfg: MoEConfig, path: ExpertPath) -> tuple:
        return expert_parallel.ep_moe_forward_sharded(params, x, cfg, mesh, path)

    path = ExpertPath(backend="te", exchange="all_to_all", dispatch_chunks=chunks)
    check_against_reference(CFG, path, BF16_TOL, forward)


@pytest.mark.parametrize("backend", ["tokamax", "te"])
def test_partial_groups_match_ragged_dot(backend: str) -> None:
    """Rows past the groups (the expert-parallel receive buffer's empty slots): the real kernels, guarded,
    give jax.lax.ragged_dot's zeros, and gradients close to float32 ones; unguarded tokamax left those rows
    unwritten on the H200. tokamax 0.0.17's weight gradient is itself far from float32: 0.3-9.3% per group
    for its kernel alone, against 0.2% for BF16 ragged_dot (H200, 2026-11-30; printed each run), so its dW
    bound is looser; dx, and TE's dW, meet the BF16 bound."""
    from maxtext_moe.moe.gemm import grouped_matmul

    x = jax.random.normal(jax.random.key(0), (4096, 512), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (8, 512, 256), jnp.bfloat16) / 16
    sizes = jnp.array([300, 0, 700, 128, 129, 500, 1, 242], jnp.int32)  # 2000 of 4096 rows

    def loss(x, w, b, partial):
        return jnp.sum(jnp.sin(grouped_matmul(x, w, sizes, b, partial=partial).astype(jnp.float32)))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=(2, 3))
    want = grad(x.astype(jnp.float32), w.astype(jnp.float32), "ragged_dot", False)
    if backend == "tokamax":
        import tokamax

        def raw(x, w):
            y = tokamax.ragged_dot(
                x,
                w,
                group_sizes=tokamax.RaggedDotGroupSizes(sizes, x.shape[0]),
                preferred_element_type=x.dtype,
                implementation="mosaic",
            )
            return jnp.sum(jnp.where(jnp.arange(4096)[:, None] < 2000, jnp.sin(y.astype(jnp.float32)), 0))

        dw_raw, dw_bf16 = jax.jit(jax.grad(raw, argnums=1))(x, w), grad(x, w, "ragged_dot", False)[1]
        print(
            "per-group dW rel. error against float32, sizes",
            np.asarray(sizes).tolist(),
            "\n  tokamax unguarded:",
            [round(rel(dw_raw[g], want[1][g]), 4) for g in (0, 2, 3, 4, 5, 6, 7)],
            "\n  ragged_dot BF16:  ",
            [round(rel(dw_bf16[g], want[1][g]), 4) for g in (0, 2, 3, 4, 5, 6, 7)],
        )
    out = jax.jit(grouped_matmul, static_argnames=("backend", "partial"))(x, w, sizes, backend=backend, partial=True)
    assert not np.asarray(out[2000:], np.float32).any()
    assert rel(out[:2000], jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)[:2000]) < 1e-2
    bounds = {"dx": 2e-2, "dw": 1.5e-1 if backend == "tokamax" else 2e-2}
    for (name, bound), got, ref in zip(bounds.items(), grad(x, w, backend, True), want, strict=True):
        assert np.isfinite(np.asarray(got, np.float32)).all() and rel(got, ref) < bound, (name, rel(got, ref))


@pytest.mark.parametrize("fp8", ["none", "current_scaling"])
def test_te_gemm_bound_as_one_primitive_gives_what_te_gives(fp8: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`opaque_vjp` around TE's grouped GEMM (what lets scanned layers compile) changes no value: output and
    both gradients equal TE called directly, on the same rows."""
    from maxtext_moe.moe import gemm

    x = jax.random.normal(jax.random.key(0), (1024, 512), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (8, 512, 256), jnp.bfloat16) / 16
    sizes = jnp.array([100, 28, 300, 0, 196, 160, 100, 140], jnp.int32)
    cot = jax.random.normal(jax.random.key(2), (1024, 256), jnp.float32)

    def value_and_grads() -> tuple:
        def loss(x, w):
            return jnp.sum(gemm.grouped_matmul(x, w, sizes, "te", fp8).astype(jnp.float32) * cot)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

    wrapped = value_and_grads()
    monkeypatch.setattr(gemm, "opaque_vjp", lambda f, num_diff, residual_name=None: f)
    direct = value_and_grads()
    for a, b in zip(jax.tree.leaves(wrapped), jax.tree.leaves(direct), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("fp8", ["none", "current_scaling"])
def test_te_layers_scanned_train_as_unrolled_ones(fp8: str) -> None:
    """Three rematerialised layers of the expert-parallel block (TE's grouped GEMM) in `jax.lax.scan` and in a
    Python loop, as MaxText runs them scanned or unrolled. BF16 rounds differently in the two programs and
    that moves a few routing choices, so they agree closely, not exactly (the same layers on the CPU with
    ragged_dot: loss 0.3%, gradients 1-4%)."""
    from jax.sharding import Mesh

    from maxtext_moe.moe import expert_parallel
    from maxtext_moe.moe.settings import EP_AXIS

    mesh = Mesh(np.array(jax.devices()[:1]), (EP_AXIS,))
    path = ExpertPath(backend="te", fp8=fp8, exchange="all_to_all")
    stacked = jax.vmap(lambda k: init_params(k, CFG, jnp.bfloat16))(jax.random.split(jax.random.key(0), 3))
    x = jax.random.normal(jax.random.key(1), (1024, CFG.emb_dim), jnp.bfloat16)

    @jax.checkpoint
    def layer(x: jax.Array, p: dict) -> tuple[jax.Array, None]:
        return x + expert_parallel.ep_moe_forward_sharded(p, x, CFG, mesh, path)[0], None

    def scanned(ps: dict, x: jax.Array) -> jax.Array:
        return jnp.sum(jax.lax.scan(layer, x, ps)[0].astype(jnp.float32) ** 2)

    def unrolled(ps: dict, x: jax.Array) -> jax.Array:
        for i in range(3):
            x = layer(x, jax.tree.map(lambda a: a[i], ps))[0]  # noqa: B023
        return jnp.sum(x.astype(jnp.float32) ** 2)

    (v_s, g_s), (v_u, g_u) = (jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(stacked, x) for f in (scanned, unrolled))
    assert np.isfinite(float(v_s)) and abs(float(v_s) / float(v_u) - 1) < 1e-2, (float(v_s), float(v_u))
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_u), strict=True):
        if np.any(np.asarray(b, np.float32)):  # the gate bias takes no gradient
            assert rel(a, b) < 0.1


def test_receive_side_as_the_block_runs_it_equals_the_formulation_through_every_slot() -> None:
    """One EP8 rank's receive side (rows with 8 expert slots, about one of them this rank's) through TE: the
    block's gathers (`receive.expand_reduce`) and the direct formulation through a row for every slot
    (benchmarks/bench_receive.py's `every_slot`) give the same loss and gradients in every input."""
    from maxtext_moe.moe import receive

    bench_receive = benchmark("bench_receive")
    x, experts, row_experts, row_weights, cap = bench_receive.receive_case(jax.random.key(0), 2048, 8, 8, 8, 1024, 256)
    path = ExpertPath(backend="te")
    forms = (
        lambda x, e, w: receive.expand_reduce(x, row_experts, w, e, path, cap)[0],
        lambda x, e, w: bench_receive.every_slot(x, row_experts, w, e, path, cap),
    )
    loss_and_grads = [
        jax.jit(jax.value_and_grad(lambda x, e, w, fn=fn: jnp.sum(fn(x, e, w).astype(jnp.float32)), (0, 1, 2)))(
            x, experts, row_weights
        )
        for fn in forms
    ]
    (la, ga), (lb, gb) = loss_and_grads
    assert abs(float(la - lb)) <= 1e-2 * abs(float(lb))
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all() and rel(a, b) < 2e-2


def test_router_logits_on_the_gpu_are_the_exact_products_summed_in_float32() -> None:
    """On the GPU the router's split-BF16 dot gives, for BF16 activations and weights at the proxy's width, the
    logits of a float64 product to float32 summation (plain BF16 would be off by about 2e-3), and gradients as
    close to float64 as their BF16 rounding allows: `benchmarks/bench_router.py`'s check of the layer's dot."""
    run = benchmark("bench_router").run_one("layer", tokens=4096, width=7168, experts=32, warmup=0, iters=1)
    assert run["rel_err_logits"] < 1e-6
    assert run["rel_err_dx"] < 4e-3 and run["rel_err_dw"] < 4e-3
