"""Expert-parallel dispatch on two GPUs: the real exchanges against the emulation, and our adjoint of the
exchange against autodiff of the emulation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rel
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import exchange, expert_parallel
from maxtext_moe.moe.layer import MoEConfig, init_params
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import EP_AXIS, ExpertPath

CFG = MoEConfig(
    emb_dim=32,
    moe_mlp_dim=16,
    shared_mlp_dim=16,
    routing=RoutingConfig(num_experts=16, top_k=4, n_groups=4, topk_groups=2),
)
TOKENS = 64


@pytest.mark.gpu
@pytest.mark.skipif(sum(d.platform == "gpu" for d in jax.devices()) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("impl", ["ragged_all_to_all", "all_to_all"])
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("chunks", [1, 2])
def test_real_exchange_matches_emulation_on_two_gpus(dedup: bool, impl: str, chunks: int) -> None:
    """The real collectives, in one dispatch or two chunks (`moe.dispatch_chunks`), against the emulation."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), (EP_AXIS,))
    params = init_params(jax.random.key(12), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(13), (TOKENS, CFG.emb_dim))
    cot = jax.random.normal(jax.random.key(14), x.shape)

    def run(impl: str, chunks: int = 1) -> tuple[jax.Array, ...]:
        path = ExpertPath(exchange=impl, dedup=dedup, dispatch_chunks=chunks)
        fwd = functools.partial(expert_parallel.ep_moe_forward_sharded, cfg=CFG, mesh=mesh, path=path)
        y = jax.jit(lambda p, x: fwd(p, x)[0])(params, x)
        return y, *jax.jit(jax.grad(lambda p, x: jnp.sum(fwd(p, x)[0] * cot), (0, 1)))(params, x)

    real, emulated = run(impl, chunks), run("emulated")
    assert rel(real[0], emulated[0]) < 1e-5
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(real[1:]), jax.tree.leaves(emulated[1:]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b)) or rel(a, b) < 1e-5, jax.tree_util.keystr(path)


@pytest.mark.gpu
@pytest.mark.skipif(sum(d.platform == "gpu" for d in jax.devices()) < 2, reason="needs 2 GPUs")
def test_exchange_gradient_on_two_gpus_equals_autodiff_of_the_emulation() -> None:
    """Our adjoint of the real exchange against JAX's autodiff of the all_gather emulation (plain gathers),
    on a random ragged plan; JAX's own transpose of ragged_all_to_all is printed beside it for the record."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), (EP_AXIS,))
    sizes = jnp.array([[3, 5], [4, 2]], jnp.int32)  # rows rank s sends rank d
    operand = jax.random.normal(jax.random.key(0), (2 * 8, 3))
    cot = jax.random.normal(jax.random.key(1), (2 * 9, 3))

    def per_rank(op: jax.Array, sz: jax.Array, g: jax.Array, how: str) -> jax.Array:
        send = sz[0]
        in_off = jnp.cumsum(send) - send
        me = jax.lax.axis_index(EP_AXIS)
        every = jax.lax.all_gather(send, EP_AXIS)
        out_off = (jnp.cumsum(every, axis=0) - every)[me]  # where my rows land in each destination
        recv = every[:, me]
        args = (in_off, send, out_off, recv)
        if how == "ours":

            def f(o):
                return exchange.exchange(o, *args, rows=9, axis_name=EP_AXIS, impl="ragged_all_to_all", block=8)
        else:
            raw = (
                jax.lax.ragged_all_to_all
                if how == "jax"
                else functools.partial(exchange._emulated_ragged_all_to_all, axis_name=EP_AXIS)
            )
            kw = {"axis_name": EP_AXIS} if how == "jax" else {}

            def f(o):
                return raw(o, jnp.zeros((9, 3)), *args, **kw)

        return jax.vjp(f, op)[1](g)[0]

    def grad(how: str) -> np.ndarray:
        body = functools.partial(per_rank, how=how)
        return np.asarray(
            jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(EP_AXIS),) * 3, out_specs=P(EP_AXIS), check_vma=False))(
                operand, sizes, cot
            )
        )

    reference, ours = grad("emulated"), grad("ours")
    print(f"JAX's transpose of ragged_all_to_all: rel. difference {rel(grad('jax'), reference):.3g} to the emulation")
    assert rel(ours, reference) < 1e-6
