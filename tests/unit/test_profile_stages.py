"""The profile's split by stage reads the MoE block's named scopes back from a real compiled step's HLO:
routing and row shuffles, expert GEMMs, and the update after the gradient as the optimizer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp

from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath
from maxtext_moe.tools import profile

CFG = MoEConfig(64, 32, RoutingConfig(num_experts=8, top_k=2, n_groups=2, topk_groups=1), shared_mlp_dim=32)


def test_compiled_step_ops_fall_into_the_block_stages(tmp_path: Path) -> None:
    params = init_params(jax.random.key(0), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (64, CFG.emb_dim))

    def step(p: dict, x: jax.Array) -> dict:
        grads = jax.grad(lambda p: jnp.sum(moe_forward(p, x, CFG, ExpertPath())[0] ** 2))(p)
        return jax.tree.map(lambda w, g: w - 1e-3 * jnp.sign(g), p, grads)

    hlo = tmp_path / "jit_train_step.after_optimizations.txt"
    hlo.write_text(jax.jit(step).lower(params, x).compile().as_text())
    names = profile.op_names(hlo)
    stages = Counter(profile.stage(op, op, name) for op, name in names.items())
    assert stages["routing, permute, unpermute"] and stages["expert GEMMs"] and stages["optimizer"], stages
    routing = [n for op, n in names.items() if profile.stage(op, op, n) == "routing, permute, unpermute"]
    assert any("jvp(" in n for n in routing) and any("transpose(" in n for n in routing)  # forward and backward
    assert profile.stage("nvjet_sm90_tst_128x256", "custom-call.3", "jit(s)/jvp()/dot_general") == "dense GEMMs"
    assert profile.stage("cudnn_fmha_bprop", "custom-call.9", "") == "attention backward"
    assert profile.stage("ncclDevKernel_AllGather", "all-gather-start", "") == "communication"
