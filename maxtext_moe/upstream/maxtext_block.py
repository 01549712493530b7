"""MaxText's own `RoutedAndSharedMoE`, built on the same parameters as our layer: the yardstick.

The benchmarks compare our block with MaxText's best GPU path (`sparse_matmul=true megablox=false
use_tokamax_gmm=true`) on the same input in the same run, and our tests check that both compute the same
function. Both need MaxText's block outside a full model; this builds it from MaxText's own config model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from maxtext_moe.errors import UserError
from maxtext_moe.moe.layer import MoEConfig, Params
from maxtext_moe.recipe import maxtext_keys


def maxtext_moe_fn(
    cfg: MoEConfig, params: Params, *, batch: int, seq: int, dtype: str, use_tokamax_gmm: bool
) -> tuple[Callable[[Any, jax.Array], jax.Array], Any]:
    """Return (fn(state, x[batch, seq, emb]) -> y, state) for MaxText's DeepSeek MoE block holding `params`.

    `state` is the nnx `Param` state (our tree less the selection bias, which MaxText keeps as a `MoEBiasVar`
    outside it, like the rest of its non-trainable state); `fn` is pure, so it can be jitted and
    differentiated like our layer.
    """
    import flax.linen as nn
    from flax import nnx
    from maxtext.configs import pyconfig
    from maxtext.layers import initializers, moe
    from maxtext.utils import maxtext_utils

    r = cfg.routing
    keys = {
        "model_name": "deepseek3-671b",
        "override_model_config": "true",
        "base_num_decoder_layers": 2,
        "first_num_dense_layers": 1,
        "base_emb_dim": cfg.emb_dim,
        "base_moe_mlp_dim": cfg.moe_mlp_dim,
        "num_experts": r.num_experts,
        "num_experts_per_tok": r.top_k,
        "shared_experts": 1,
        "n_routing_groups": r.n_groups if r.n_groups > 1 else -1,
        "topk_routing_group": r.topk_groups if r.n_groups > 1 else -1,
        "routed_scaling_factor": r.routed_scaling_factor,
        "per_device_batch_size": batch,
        "max_target_length": seq,
        "dtype": dtype,
        "weight_dtype": dtype,
        "sparse_matmul": "true",
        "megablox": "false",
        "use_tokamax_gmm": str(use_tokamax_gmm).lower(),
        "log_config": "false",
        "skip_jax_distributed_system": "true",
        "hardware": "gpu" if jax.devices()[0].platform == "gpu" else "cpu",
        "enable_checkpointing": "false",
    }
    if cfg.shared_mlp_dim != cfg.moe_mlp_dim:
        raise UserError(
            "MaxText's shared expert is shared_experts x moe_mlp_dim wide; use shared_mlp_dim == moe_mlp_dim."
        )
    mt = pyconfig.initialize(["maxtext-moe", str(maxtext_keys.base_yml())] + [f"{k}={v}" for k, v in keys.items()])
    mesh = maxtext_utils.get_mesh_from_config(mt)
    with jax.set_mesh(mesh), nn.logical_axis_rules(mt.logical_axis_rules):
        block = moe.RoutedAndSharedMoE(
            config=mt,
            mesh=mesh,
            kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
            kernel_axes=("embed", None),
            dtype=mt.dtype,
            weight_dtype=mt.weight_dtype,
            rngs=nnx.Rngs(0),
        )
    for path, value in jax.tree_util.tree_flatten_with_path(params)[0]:
        var = block
        for entry in path:
            var = getattr(var, entry.key)
        if var.shape != value.shape:
            raise UserError(f"MaxText's {'/'.join(e.key for e in path)} is {var.shape}, ours {value.shape}.")
        var.set_value(value.astype(jnp.dtype(dtype)))
    graph, state, rest = nnx.split(block, nnx.Param, ...)  # rest: selection bias and RNG state, not differentiated

    def fn(st: Any, x: jax.Array) -> jax.Array:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(mt.logical_axis_rules):
            return nnx.merge(graph, st, rest)(x)[0]

    return fn, state
