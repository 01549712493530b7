"""Expert-parallel dispatch with per-rank dedup against the single-device layer (CPU; GPU tests: tests/gpu)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel

from maxtext_moe.errors import UserError
from maxtext_moe.moe import expert_parallel, receive, send_plan
from maxtext_moe.moe.exchange import exchange
from maxtext_moe.moe.layer import MoEConfig, fuse_up, init_params, moe_forward
from maxtext_moe.moe.reference import moe_reference
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import EP_AXIS, ExpertPath
from maxtext_moe.run.distributed import free_port

CFG = MoEConfig(
    emb_dim=32,
    moe_mlp_dim=16,
    shared_mlp_dim=16,
    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
)
TOKENS = 64


def ep_forward(ranks: int, dedup: bool):
    return jax.jit(
        functools.partial(expert_parallel.ep_moe_forward_emulated, cfg=CFG, ranks=ranks, path=ExpertPath(dedup=dedup))
    )


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_emulated_ep_matches_single_device_layer_and_reference(ranks: int, dedup: bool) -> None:
    params = init_params(jax.random.key(ranks), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(10 + ranks), (2, TOKENS // 2, CFG.emb_dim))
    y, routing = ep_forward(ranks, dedup)(params, x)
    y_one, routing_one = moe_forward(params, x, CFG)
    np.testing.assert_array_equal(np.asarray(routing.indices), np.asarray(routing_one.indices))
    np.testing.assert_array_equal(np.asarray(routing.counts), np.asarray(routing_one.counts))
    assert y.shape == x.shape
    assert rel(y, y_one) < 1e-6
    assert rel(y, moe_reference(params, x, CFG)) < 1e-5


def test_emulated_ep_splits_a_fused_up_projection_over_the_ranks() -> None:
    """MaxText's `prefuse_moe_weights` tree (one `wi` for wi_0 and wi_1) is split over the ranks by expert, as
    wi_0 and wi_1 are: the same output as unfused."""
    params = init_params(jax.random.key(2), CFG, jnp.float32)
    fused = {**params, "MoeBlock_0": fuse_up(params["MoeBlock_0"])}
    x = jax.random.normal(jax.random.key(12), (TOKENS, CFG.emb_dim))
    assert rel(ep_forward(4, True)(fused, x)[0], ep_forward(4, True)(params, x)[0]) < 1e-6


@pytest.mark.parametrize("dedup", [True, False])
def test_emulated_ep_gradients_match_single_device_layer(dedup: bool) -> None:
    params = init_params(jax.random.key(3), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(4), (TOKENS, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(5), x.shape)
    ep = functools.partial(expert_parallel.ep_moe_forward_emulated, cfg=CFG, ranks=4, path=ExpertPath(dedup=dedup))
    g = jax.jit(jax.grad(lambda p, x: jnp.sum(ep(p, x)[0] * cot), (0, 1)))(params, x)
    g_one = jax.jit(jax.grad(lambda p, x: jnp.sum(moe_forward(p, x, CFG)[0] * cot), (0, 1)))(params, x)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g)[0], jax.tree.leaves(g_one), strict=True):
        if "bias" in jax.tree_util.keystr(path):
            assert not np.asarray(a).any() and not np.asarray(b).any()
        else:
            assert rel(a, b) < 1e-5, path


@pytest.mark.parametrize("chunks", [2, 4])
def test_dispatch_in_chunks_computes_what_one_dispatch_does(chunks: int) -> None:
    """Each rank's tokens planned, exchanged and computed in chunks: the same outputs, routing and
    gradients as one dispatch (every token's expert rows are the same rows, only sent in other calls)."""
    params = init_params(jax.random.key(7), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(8), (TOKENS, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(9), x.shape)

    def run(n: int) -> tuple:
        ep = functools.partial(
            expert_parallel.ep_moe_forward_emulated, cfg=CFG, ranks=4, path=ExpertPath(dispatch_chunks=n)
        )
        y, routing = jax.jit(ep)(params, x)
        grads = jax.jit(jax.grad(lambda p, x: jnp.sum(ep(p, x)[0] * cot), (0, 1)))(params, x)
        return y, routing, grads

    y, routing, grads = run(chunks)
    y_one, routing_one, grads_one = run(1)
    np.testing.assert_array_equal(np.asarray(routing.indices), np.asarray(routing_one.indices))
    assert float(routing.dropped) == float(routing_one.dropped) == 0.0
    assert rel(y, y_one) < 1e-6
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one), strict=True):
        if np.asarray(b).any():
            assert rel(a, b) < 1e-6
        else:  # the gate bias: no gradient in either
            assert not np.asarray(a).any()


def test_dispatch_chunks_that_do_not_divide_the_tokens_are_refused() -> None:
    params = init_params(jax.random.key(7), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(8), (24, CFG.emb_dim))  # 6 tokens per rank of 4
    with pytest.raises(UserError, match="6 tokens per expert-parallel rank do not split into 4 dispatch chunks"):
        expert_parallel.ep_moe_forward_emulated(params, x, CFG, 4, ExpertPath(dispatch_chunks=4))


def test_plan_sends_each_token_once_per_rank_with_its_local_experts() -> None:
    ids = jnp.array([[0, 1, 5], [6, 7, 4], [2, 3, 1]], jnp.int32)  # 8 experts on 2 ranks: 4 local each
    w = jnp.array([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    plan = send_plan.plan_dispatch(ids, w, num_experts=8, ranks=2)
    np.testing.assert_array_equal(np.asarray(plan.send_counts), [2, 2])
    np.testing.assert_array_equal(np.asarray(plan.send_offsets), [0, 2])
    np.testing.assert_array_equal(np.asarray(plan.row_token), [0, 2, 0, 1, 0, 0])  # rank 0: t0, t2; rank 1: t0, t1
    np.testing.assert_array_equal(np.asarray(plan.row_experts)[:4], [[0, 1, -1], [2, 3, 1], [1, -1, -1], [2, 3, 0]])
    np.testing.assert_allclose(
        np.asarray(plan.row_weights)[:4], [[0.1, 0.2, 0], [0.7, 0.8, 0.9], [0.3, 0, 0], [0.4, 0.5, 0.6]]
    )
    assert (np.asarray(plan.row_experts)[4:] == -1).all() and plan.peer_rows == 3
    copies = send_plan.plan_dispatch(ids, w, num_experts=8, ranks=2, dedup=False)
    np.testing.assert_array_equal(np.asarray(copies.send_counts), [5, 4])
    np.testing.assert_array_equal(np.asarray(copies.row_token), [0, 0, 2, 2, 2, 0, 1, 1, 1])
    assert copies.row_experts.shape == (9, 1) and copies.peer_rows == 9


def test_bytes_with_dedup_never_exceed_without_and_are_equal_for_top1() -> None:
    ids = jax.random.randint(jax.random.key(6), (256, 6), 0, 32)
    bytes_for = functools.partial(send_plan.dispatch_bytes_per_token, num_experts=32, ranks=4, hidden=8, dtype_bytes=2)
    assert bytes_for(ids, dedup=True) < bytes_for(ids, dedup=False)
    assert bytes_for(ids[:, :1], dedup=True) == bytes_for(ids[:, :1], dedup=False) > 0
    # Two tokens per rank on 2 ranks of 4 experts; rows a rank keeps for itself are free.
    ids = jnp.array([[4, 5], [0, 6], [0, 1], [2, 7]], jnp.int32)
    bytes_for = functools.partial(send_plan.dispatch_bytes_per_token, num_experts=8, ranks=2, hidden=1, dtype_bytes=1)
    assert bytes_for(ids, dedup=False) == 6 / 4  # t0: 2 copies to rank 1; t1: 1; t2: 2 to rank 0; t3: 1 to rank 0
    assert bytes_for(ids, dedup=True) == 4 / 4


@pytest.mark.parametrize("favoured", [(0, 1, 2, 3), (0, 1, 8, 9)], ids=["all-to-rank-0", "ranks-1-3-idle"])
def test_ranks_receiving_nothing(favoured: tuple[int, ...]) -> None:
    params = init_params(jax.random.key(7), CFG, jnp.float32)
    params["MoeBlock_0"]["gate"]["bias"] = params["MoeBlock_0"]["gate"]["bias"].at[jnp.array(favoured)].set(10.0)
    x = jax.random.normal(jax.random.key(8), (TOKENS, CFG.emb_dim))
    y, routing = ep_forward(4, True)(params, x)
    assert set(np.unique(np.asarray(routing.indices))) == set(favoured)
    assert rel(y, moe_forward(params, x, CFG)[0]) < 1e-6


def _ranked_plans(dedup: bool) -> tuple[jax.Array, send_plan.DispatchPlan, dict]:
    params = init_params(jax.random.key(9), CFG, jnp.float32)["MoeBlock_0"]
    ids = jax.random.randint(jax.random.key(10), (4, 16, CFG.routing.top_k), 0, 16)
    plans = jax.vmap(functools.partial(send_plan.plan_dispatch, num_experts=16, ranks=4, dedup=dedup))(
        ids, jnp.ones(ids.shape)
    )
    shards = {n: params[n].reshape(4, 4, *params[n].shape[1:]) for n in ("wi_0", "wi_1", "wo")}
    return jax.random.normal(jax.random.key(11), (4, 16, CFG.emb_dim)), plans, shards


def _ep_routed(x: jax.Array, plans: send_plan.DispatchPlan, shards: dict) -> jax.Array:
    body = functools.partial(expert_parallel.ep_routed, path=ExpertPath(exchange="emulated"))
    return jax.vmap(body, axis_name=EP_AXIS)(x, plans, shards)[0]


@pytest.mark.parametrize("dedup", [True, False])
def test_dropless_check_fires_on_a_corrupted_plan(dedup: bool) -> None:
    x, plans, shards = _ranked_plans(dedup)
    assert np.isfinite(np.asarray(_ep_routed(x, plans, shards))).all()
    short = dataclasses.replace(plans, send_counts=plans.send_counts.at[0, 1].add(-1))  # one row 0 -> 1 lost
    with pytest.raises(Exception, match="EP dispatch is not dropless"):
        _ep_routed(x, short, shards).block_until_ready()
    wrong = dataclasses.replace(plans, row_experts=plans.row_experts.at[2, 0, 0].set(7))  # rank holds 0..3 only
    with pytest.raises(Exception, match="EP dispatch is not dropless"):
        _ep_routed(x, wrong, shards).block_until_ready()


@pytest.mark.parametrize("dedup", [True, False])
def test_lost_copies_are_measured_with_the_check_off(dedup: bool) -> None:
    """What the ranks' experts computed, not the plan's intent: a row the exchange never delivers shows up as
    lost copies (one, or with dedup up to top-k, which that row carried), on every rank alike."""
    x, plans, shards = _ranked_plans(dedup)
    body = functools.partial(expert_parallel.ep_routed, path=ExpertPath(exchange="emulated"), check=False)
    expected = 4 * 16 * CFG.routing.top_k  # 4 ranks x 16 tokens x top-k
    _, computed = jax.vmap(body, axis_name=EP_AXIS)(x, plans, shards)
    np.testing.assert_array_equal(np.asarray(computed), expected)
    short = dataclasses.replace(plans, send_counts=plans.send_counts.at[0, 1].add(-1))
    _, computed = jax.vmap(body, axis_name=EP_AXIS)(x, short, shards)
    lost = expected - np.asarray(computed)
    assert len(set(lost)) == 1 and (1 <= lost[0] <= CFG.routing.top_k if dedup else lost[0] == 1), lost


def test_plan_rejects_experts_out_of_range_and_uneven_splits() -> None:
    with pytest.raises(UserError, match="not dropless"):
        send_plan.plan_dispatch(jnp.array([[0, 16]], jnp.int32), jnp.ones((1, 2)), num_experts=16, ranks=4)
    with pytest.raises(UserError, match="does not divide"):
        send_plan.plan_dispatch(jnp.array([[0, 1]], jnp.int32), jnp.ones((1, 2)), num_experts=16, ranks=3)
    with pytest.raises(UserError, match="split evenly"):
        expert_parallel.ep_moe_forward_emulated(
            init_params(jax.random.key(0), CFG, jnp.float32), jnp.ones((6, CFG.emb_dim)), CFG, ranks=4
        )
    with pytest.raises(UserError, match="emulated"):
        exchange(*[jnp.zeros(2)] * 5, rows=2, axis_name=EP_AXIS, impl="nccl", block=1)


_TWO_CPU_DEVICES = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from maxtext_moe.errors import UserError
    from maxtext_moe.moe import expert_parallel
    from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
    from maxtext_moe.moe.routing import RoutingConfig
    from maxtext_moe.moe.settings import EP_AXIS, ExpertPath

    cfg = MoEConfig(emb_dim=32, moe_mlp_dim=16, shared_mlp_dim=16,
                    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2))
    params = init_params(jax.random.key(0), cfg, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (64, 32))
    mesh = Mesh(np.array(jax.devices()), (EP_AXIS,))
    emulated = ExpertPath(exchange="emulated")
    y = jax.jit(lambda p, x: expert_parallel.ep_moe_forward_sharded(p, x, cfg, mesh, emulated)[0])(params, x)
    y_one = moe_forward(params, x, cfg)[0]
    cot = jax.random.normal(jax.random.key(2), x.shape)
    grads = jax.jit(jax.grad(lambda p, x: jnp.sum(
        expert_parallel.ep_moe_forward_sharded(p, x, cfg, mesh, emulated)[0] * cot), (0, 1)))(params, x)
    grads_one = jax.grad(lambda p, x: jnp.sum(moe_forward(p, x, cfg)[0] * cot), (0, 1))(params, x)
    grad_rel = max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
                   for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)) if jnp.any(b != 0))
    errors = {}
    for gpu_only in ("ragged_all_to_all", "nccl_ep"):
        try:
            expert_parallel.ep_moe_forward_sharded(params, x, cfg, mesh, ExpertPath(exchange=gpu_only))
            errors[gpu_only] = None
        except UserError as e:
            errors[gpu_only] = str(e)
    print(json.dumps({"devices": len(jax.devices()), "errors": errors, "grad_rel": grad_rel,
                      "rel": float(jnp.linalg.norm(y - y_one) / jnp.linalg.norm(y_one))}))
""")


def test_sharded_path_on_two_cpu_devices() -> None:
    """shard_map over 2 CPU devices: the emulated exchange matches the layer, outputs and gradients (which run
    through our adjoint of the exchange, as on GPUs); the GPU-only ones are refused clearly (XLA:CPU in JAX
    0.11.2 fails to compile `ragged-all-to-all` with an UNIMPLEMENTED opcode error; NCCL EP is NCCL's)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_CPU_DEVICES], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2 and result["rel"] < 1e-6 and result["grad_rel"] < 1e-5
    for gpu_only in ("ragged_all_to_all", "nccl_ep"):
        assert f"{gpu_only} does not run on CPU devices" in result["errors"][gpu_only]
        assert "pass exchange='all_to_all' or 'emulated'" in result["errors"][gpu_only]


_FOUR_CPU_DEVICES = textwrap.dedent("""
    import itertools, json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from maxtext_moe.moe import expert_parallel
    from maxtext_moe.moe.layer import MoEConfig, init_params
    from maxtext_moe.moe.routing import RoutingConfig
    from maxtext_moe.moe.settings import EP_AXIS, ExpertPath

    cfg = MoEConfig(emb_dim=32, moe_mlp_dim=16, shared_mlp_dim=16,
                    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2))
    mesh = Mesh(np.array(jax.devices()), (EP_AXIS,))
    x = jax.random.normal(jax.random.key(1), (128, 32))
    cot = jax.random.normal(jax.random.key(2), x.shape)
    worst = {}
    for dedup, favoured, factor in itertools.product((True, False), (None, (0, 1, 2, 3)), (-1.0, 2.0)):
        if favoured and factor > 0:
            continue  # everything on rank 0 overflows a capped buffer by design (the guard's own test)
        params = init_params(jax.random.key(0), cfg, jnp.float32)
        if favoured:
            bias = params["MoeBlock_0"]["gate"]["bias"]
            params["MoeBlock_0"]["gate"]["bias"] = bias.at[jnp.array(favoured)].set(10.0)

        def run(impl, chunks=1):
            path = ExpertPath(exchange=impl, dedup=dedup, buffer_factor=factor, dispatch_chunks=chunks)
            f = lambda p, x: expert_parallel.ep_moe_forward_sharded(p, x, cfg, mesh, path)[0]
            return [f(params, x), *jax.grad(lambda p, x: jnp.sum(f(p, x) * cot), (0, 1))(params, x)]

        ref = jax.tree.leaves(jax.jit(lambda: run("emulated"))())
        for chunks in (1, 2) if dedup else (1,):  # two chunks: the recipes' dedup dispatch
            a2a = jax.tree.leaves(jax.jit(lambda: run("all_to_all", chunks))())
            worst[f"dedup={dedup} favoured={favoured} factor={factor} chunks={chunks}"] = max(
                float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30)) for a, b in zip(a2a, ref))
    print(json.dumps({"devices": len(jax.devices()), "worst": worst}))
""")


def test_dense_all_to_all_exchange_equals_the_emulation_on_four_cpu_devices() -> None:
    """The exchange that trains ("all_to_all": XLA's all-to-all of per-destination blocks, a real collective
    on XLA:CPU too) against the emulation: outputs and every gradient, dedup and not, balanced routing,
    every token on rank 0's experts, and a capped receive buffer; in one dispatch, and with dedup in two
    chunks."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", _FOUR_CPU_DEVICES], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["devices"] == 4 and len(result["worst"]) == 9
    assert max(result["worst"].values()) < 1e-5, result["worst"]


@pytest.mark.parametrize("processes", [1, 2])
def test_ep_dispatch_benchmark_script_on_two_cpu_devices(tmp_path, processes: int) -> None:
    """benchmarks/bench_ep_dispatch.py end to end on 2 CPU devices (the dense all-to-all, a real collective
    there), driven by one process or by one process each (the layout that runs on two GPUs): both dispatch
    modes compute the single-device layer, and dedup sends fewer rows per token than one per chosen
    expert, padding on the wire included."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_ep_dispatch.py")
    out = tmp_path / "ep.json"
    args = [
        sys.executable,
        script,
        "--tokens-per-device",
        "64",
        "--experts",
        "16",
        "--emb",
        "64",
        "--mlp",
        "32",
        "--top-k",
        "4",
        "--groups",
        "4",
        "2",
        "--backend",
        "ragged_dot",
        "--impl",
        "all_to_all",
        "--dtype",
        "float32",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--out",
        str(out),
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={3 - processes}")
    if processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(processes))
    procs = [
        subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env, JAX_PROCESS_ID=str(i)) if processes > 1 else env,
        )
        for i in range(processes)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    stdout = outputs[0][0]
    result = json.loads(out.read_text())
    plain, dedup = result["runs"]
    for run in (plain, dedup):
        assert run["finite"] and run["rel_err_y_vs_one_device"] < 1e-5 and run["rel_err_dx_vs_one_device"] < 1e-5
    # Half the experts live on the other rank: about top_k / 2 rows per token without dedup, at most one with.
    assert 1.0 < plain["rows_per_token_sent"] <= 4.0 and 0.5 < dedup["rows_per_token_sent"] <= 1.0
    # On the wire, one block per peer: 64 rows with dedup, 64 x min(top-k 4, 8 local experts) without.
    assert (plain["wire_rows_per_token"], dedup["wire_rows_per_token"]) == (4.0, 1.0)
    assert result["dedup_bytes_factor"] == pytest.approx(plain["kib_per_token_sent"] / dedup["kib_per_token_sent"])
    assert result["processes"] == processes and f"({processes} process(es))" in stdout
    assert "dedup:" in stdout and "fewer bytes" in stdout
    assert all("dedup" not in out for out, _ in outputs[1:])  # process 0 alone reports


def test_te_backend_gets_groups_that_cover_every_received_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """TE's grouped GEMM asserts sum(group_sizes) == rows (seen on two H200s: "Unexpected group_sizes! M =
    131072, got sum(group_sizes)=64935"), while an EP receive buffer holds empty slots. With a stand-in for
    TE that enforces the same, the EP layer on the "te" backend still computes the single-device layer."""
    from maxtext_moe.moe import gemm

    def grouped_dense(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        def check(total: np.ndarray, rows: int) -> None:
            if int(total) != rows:
                raise AssertionError(f"Unexpected group_sizes! M = {rows}, got sum(group_sizes)={int(total)}")

        jax.debug.callback(functools.partial(check, rows=x.shape[0]), jnp.sum(sizes))
        return jax.lax.ragged_dot(x, w, sizes)

    monkeypatch.setattr(gemm.te, "import_te", lambda: (types.SimpleNamespace(grouped_dense=grouped_dense), None))
    monkeypatch.setattr(gemm, "select_te_grouped_gemm_path", lambda requested="auto": "v1")
    params = init_params(jax.random.key(20), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(21), (TOKENS, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(22), x.shape)

    def loss(forward):
        return jax.grad(lambda p, x: jnp.sum(forward(p, x)[0] * cot), (0, 1))

    y = expert_parallel.ep_moe_forward_emulated(params, x, CFG, 2, ExpertPath(backend="te"))[0]
    assert rel(y, moe_forward(params, x, CFG)[0]) < 1e-6
    ep = loss(lambda p, x: expert_parallel.ep_moe_forward_emulated(p, x, CFG, 2, ExpertPath(backend="te")))(params, x)
    one = loss(lambda p, x: moe_forward(p, x, CFG))(params, x)
    for a, b in zip(jax.tree.leaves(ep), jax.tree.leaves(one), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)) or rel(a, b) < 1e-5


def test_capped_expert_copies_shrink_the_te_gemms_and_keep_the_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """The receive side with `copies_cap`: TE's grouped GEMMs (a stand-in that records its rows and, like TE,
    needs groups covering them) get the cap's rows instead of every slot of the buffer, and the output and
    all gradients equal the uncapped ones; a cap one copy short of the valid ones changes the result (why
    `ep_routed` guards it)."""
    from maxtext_moe.moe import gemm

    seen: list[int] = []

    def grouped_dense(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
        seen.append(x.shape[0])
        return jax.lax.ragged_dot(x, w, sizes)

    monkeypatch.setattr(gemm.te, "import_te", lambda: (types.SimpleNamespace(grouped_dense=grouped_dense), None))
    monkeypatch.setattr(gemm, "select_te_grouped_gemm_path", lambda requested="auto": "v1")
    rows, slots, local = 48, 4, 8
    experts = {
        n: init_params(jax.random.key(30), CFG, jnp.float32)["MoeBlock_0"][n][:local] for n in ("wi_0", "wi_1", "wo")
    }
    ks = jax.random.split(jax.random.key(31), 4)
    row_experts = jax.random.randint(ks[0], (rows, slots), 0, local)
    row_experts = jnp.where(jax.random.uniform(ks[1], (rows, slots)) < 0.5, row_experts, -1)  # half empty
    row_weights = jnp.where(row_experts >= 0, jax.random.uniform(ks[2], (rows, slots)), 0)
    x = jax.random.normal(ks[3], (rows, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(32), x.shape)
    valid = int(jnp.sum(row_experts >= 0))
    assert valid < rows * slots * 3 // 4

    def run(cap):
        def loss(x, e):
            y, copies = receive.expand_reduce(x, row_experts, row_weights, e, ExpertPath(backend="te"), copies_cap=cap)
            return jnp.sum(y * cot), (y, copies)

        (_, (y, copies)), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(x, experts)
        return y, copies, grads

    y_all, copies, grads_all = run(None)
    assert int(copies) == valid and set(seen) == {rows * slots}
    seen.clear()
    y_cap, _, grads_cap = run(valid)
    assert set(seen) == {valid}
    assert rel(y_cap, y_all) < 1e-6
    for a, b in zip(jax.tree.leaves(grads_cap), jax.tree.leaves(grads_all), strict=True):
        assert rel(a, b) < 1e-6
    assert rel(run(valid - 1)[0], y_all) > 1e-4


def test_the_receive_sides_gradient_sums_nothing_by_a_scatter() -> None:
    """Every gradient of the receive side, the routing weights' included, is a gather by the slot -> copy map:
    the backward pass adds no scatter to those of the forward (the expert count's bincount)."""
    rows, slots, local = 48, 4, 8
    experts = {
        n: init_params(jax.random.key(30), CFG, jnp.float32)["MoeBlock_0"][n][:local] for n in ("wi_0", "wi_1", "wo")
    }
    ks = jax.random.split(jax.random.key(33), 4)
    row_experts = jax.random.randint(ks[0], (rows, slots), -1, local)
    row_weights = jax.random.uniform(ks[1], (rows, slots))
    x = jax.random.normal(ks[2], (rows, CFG.emb_dim))

    def loss(x, w, e):
        return jnp.sum(receive.expand_reduce(x, row_experts, w, e, ExpertPath())[0] ** 2)

    forward = str(jax.make_jaxpr(loss)(x, row_weights, experts)).count("scatter")
    backward = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, row_weights, experts)).count("scatter")
    assert forward >= 1 and backward == forward
