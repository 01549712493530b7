"""Put our routed-expert layer inside MaxText's DeepSeek decoder (`moe.impl: ours`).

The gap: MaxText 0.2.5 (pinned) has no hook for another MoE implementation. `DeepSeekMoELayer.__init__`
builds `moe.RoutedAndSharedMoE` directly, and `NNXDecoder.get_decoder_layers` picks the layer class by
reading the module attribute `maxtext.models.deepseek.DeepSeekMoELayer` each time a model is built (for the
decoder stack and the MTP layer alike). So `install` rebinds exactly that one symbol to a subclass.

MaxText constructs the layer class itself, with its own arguments, so our settings cannot reach the
layer as a constructor argument. `install` therefore creates a fresh subclass of `OurDeepSeekMoELayer`
per call, carrying ONE class attribute, `settings` (the recipe's `MoeSettings`): models built before a
later `install` keep the class, and so the settings, they were built with, and no shared class is
mutated.

The subclass keeps MaxText's `__init__`, so the parameters are MaxText's own: same tree
(`DeepSeekMoeBlock_0/{MoeBlock_0/{gate/{kernel,bias}, wi_0, wi_1, wo}, shared_experts/...}`, or `wi` for wi_0 and
wi_1 under MaxText's `prefuse_moe_weights`), shapes,
logical shardings, initialisers and RNG order; checkpoints move freely between `impl: maxtext` and
`impl: ours`, and a fixed seed gives the same initial model. It overrides `mlp_op`, the one place
the layer calls its MoE block (and `__call__`, only to order the backward under FSDP, see there), and
computes the routed experts with `layer.routed_experts` (our routing, sort and grouped GEMMs on the chosen
backend) on the block's own variables; the shared expert stays
MaxText's `MlpBlock`. What MaxText's loop reads from the block comes out as before: the output, the
load-balance loss (MaxText's own loss functions, fed our routing) and the aux-loss-free bias update
(MaxText's `load_balance_updates_from_counts` on our expert counts; the loop adds it to the gate bias). It
also sows its load balance (`balance_metrics.sow`), with the copies its grouped GEMMs did not reach, and,
with `moe.seq_balance_loss_weight`, DeepSeek-V3's sequence-wise balance loss as MaxText's `moe_lb_loss`,
which MaxText's step adds to the loss (MaxText computes that loss only on its own router, with another
top-k).

Expert parallelism: when MaxText's mesh has an `expert` axis of size > 1, the routed experts run through
`expert_parallel.ep_routed_sharded` under `shard_map` over MaxText's own mesh, sharded as MaxText's
`sparse_matmul` shards them: tokens by the logical axes (`activation_batch`, or `decode_batch_moe` for a
batch of 1, and `activation_norm_length`), experts by their first dimension over `expert`. The exchange is
`moe.exchange` (`exchange_impl`): by default XLA's dense all-to-all, on CPUs and GPUs alike. The receive
buffers follow MaxText's `ragged_buffer_factor` (-1: dropless worst case; > 0: that many times the balanced
rows, and a step that would need more stops with an error, see moe/receive.py). With `moe.exchange: nccl_ep`
the routed experts run through TE's NCCL EP instead (`moe/nccl_ep.py`), bootstrapped at start-up by
`nccl_ep_bootstrap.py`.

We rebind the DeepSeek layer rather than `moe.RoutedAndSharedMoE` or `moe.RoutedMoE` because those are
shared by other models and by `maxtext_block.py`, our yardstick, which must stay MaxText's block.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from maxtext.layers import moe as mt_moe
from maxtext.models import deepseek

from maxtext_moe.errors import UserError
from maxtext_moe.moe import balance, expert_parallel, gemm
from maxtext_moe.moe.backward_order import weight_grads_first
from maxtext_moe.moe.layer import FUSED_UP, MoEConfig, Params, expert_keys, gate_logits, routed_experts
from maxtext_moe.moe.routing import Routing, RoutingConfig
from maxtext_moe.moe.settings import EP_AXIS, GPU_EXCHANGES, ExpertPath, Impl, MoeSettings
from maxtext_moe.upstream import balance_metrics

log = logging.getLogger(__name__)

# MaxText's routing semantics for these model names are DeepSeek-V3's (`RoutedMoE.get_topk`).
_DEEPSEEK_ROUTING_MODELS = ("deepseek3", "kimi-k2")


def moe_config(config: Any) -> MoEConfig:
    """Our layer's shape from MaxText's config. The dropless host check is off: the expert ids come from
    `top_k` over exactly `num_experts` columns, so they are in range, and a host callback per layer per
    step would stall the GPU."""
    grouped = config.n_routing_groups > 1
    return MoEConfig(
        emb_dim=config.emb_dim,
        moe_mlp_dim=config.moe_mlp_dim,
        shared_mlp_dim=config.shared_experts * config.moe_mlp_dim,
        check_dropless=False,
        routing=RoutingConfig(
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            n_groups=config.n_routing_groups if grouped else 1,
            topk_groups=config.topk_routing_group if grouped else 1,
            routed_scaling_factor=config.routed_scaling_factor,
        ),
    )


def unsupported(config: Any, layer: deepseek.DeepSeekMoELayer) -> list[str]:
    """What in this configuration our layer does not compute (empty when it can stand in for MaxText's)."""
    routed = layer.DeepSeekMoeBlock_0.MoeBlock_0
    checks = {
        f"model_name={config.model_name} (DeepSeek-V3 routing needs a deepseek3 model)": not str(
            config.model_name
        ).startswith(_DEEPSEEK_ROUTING_MODELS),
        f"routed_score_func={config.routed_score_func!r} (ours scores with sigmoid)": config.routed_score_func
        != "sigmoid",
        f"mlp_activations={list(config.mlp_activations)} (ours computes silu(x wi_0) * (x wi_1))": list(
            config.mlp_activations
        )
        != ["silu", "linear"],
        "mlp_bias=true": bool(config.mlp_bias),
        "use_random_routing=true": bool(config.use_random_routing),
        "moe_expert_input_dim != emb_dim": config.moe_expert_input_dim > 0
        and config.moe_expert_input_dim != config.emb_dim,
        f"expert axis {routed._expert_parallelism_name!r} (ours dispatches over the mesh axis 'expert' only)": (
            routed._expert_parallelism_name != EP_AXIS
        ),
        "use_ring_of_experts=true (MaxText's own expert-parallel scheme)": bool(config.use_ring_of_experts)
        and routed.get_expert_parallelism_size() > 1,
        "pipeline parallelism with expert parallelism (shard_map under the stage vmap)": routed.mesh.shape.get(
            "stage", 1
        )
        > 1
        and routed.get_expert_parallelism_size() > 1,
        "mhc_expansion_rate > 1 (MaxText's hyper-connections call the block directly)": bool(layer.is_mhc_enabled),
        "use_batch_split_schedule=true (it bypasses the layer's MoE call)": bool(config.use_batch_split_schedule),
    }
    return [what for what, bad in checks.items() if bad]


class OurDeepSeekMoELayer(deepseek.DeepSeekMoELayer):
    """MaxText's DeepSeek MoE decoder layer whose routed experts run on our layer (see the module docstring)."""

    settings: ClassVar[MoeSettings] = MoeSettings(impl="ours")  # each `install` subclass carries its own

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        refused = unsupported(config, self)
        if refused:
            raise UserError(
                f"is ours, but our layer cannot compute this model's MoE layer: {'; '.join(refused)}.",
                key="moe.impl",
                fix="use moe.impl: maxtext for this model, or change those keys.",
            )
        self.our_moe_config = moe_config(config)
        routed = self.DeepSeekMoeBlock_0.MoeBlock_0
        self.expert_path = ExpertPath.of(self.settings, routed.get_ragged_buffer_factor())
        ranks = routed.get_expert_parallelism_size()
        if ranks > 1:
            log.info(
                "moe.impl=ours: expert parallelism %d (exchange %s, ragged_buffer_factor %s, dispatch chunks %d)",
                ranks,
                exchange_impl(routed.mesh, self.settings),
                self.expert_path.buffer_factor,
                self.expert_path.dispatch_chunks,
            )

    def __call__(self, inputs: jax.Array | tuple, *args: Any, **kwargs: Any) -> Any:
        """MaxText's layer; under FSDP its input is tied to its weights (`backward_order.weight_grads_first`):
        in the backward, the layer below starts only once this layer's weight gradients are made and
        reduce-scattered. Without it XLA left them, and the FP8 copies of their GEMM operands, to the end of
        the backward pass: a 671B compile held them for every layer at once. Without FSDP there is no such
        collective to wait for, and the barrier cost 0.7% of the one-H200 proxy's step; it is left out."""
        if self.mesh.shape.get("fsdp", 1) > 1:
            x = inputs[0] if isinstance(inputs, tuple) else inputs
            x, weights = weight_grads_first(x, nnx.state(self, nnx.Param))
            nnx.update(self, weights)
            inputs = x
        return super().__call__(inputs, *args, **kwargs)

    def mlp_op(self, x: jax.Array, deterministic: bool, *args: Any, **kwargs: Any):
        """Replaces MaxText's `self.DeepSeekMoeBlock_0(x, ...)`: (output, load-balance loss, bias update)."""
        block = self.DeepSeekMoeBlock_0
        cfg, mt = self.our_moe_config, self.config
        x = x.astype(mt.dtype)
        tokens = x.reshape(-1, cfg.emb_dim)
        params = _routed_params(block.MoeBlock_0, cfg.routing.num_experts)
        has_bias = block.MoeBlock_0.gate.bias is not None
        if block.MoeBlock_0.get_expert_parallelism_size() > 1:
            routed, routing = _expert_parallel(block.MoeBlock_0, params, x, cfg, self.settings, self.expert_path)
        else:
            routed, routing = routed_experts(params, tokens, cfg, self.expert_path)
        shared = block.shared_experts(
            x, intermediate_sharding=self.mlp_intermediate_sharding, out_sharding=self.out_sharding
        )
        out = routed.astype(mt.dtype).reshape(x.shape) + shared
        seq_loss = _sequence_balance_loss(params, tokens, x.shape, routing, self.settings.seq_balance_loss_weight)
        if seq_loss is not None:
            self.sow(nnx.Intermediate, "moe_lb_loss", seq_loss)  # MaxText's loss_fn adds it (moe_checks.maxtext_keys)
        bias = params["gate"]["bias"] if has_bias else None
        balance_metrics.sow(self, routing.counts, routing.dropped, bias, seq_loss)
        return (
            self.with_logical_constraint(out),
            _load_balance_loss(block.MoeBlock_0, params, tokens, x.shape, routing),
            _bias_update(mt, routing),
        )


def _routed_params(routed: mt_moe.RoutedMoE, num_experts: int) -> Params:
    """The `MoeBlock_0` variables as our layer's tree; a model without `routed_bias` selects with bias 0."""
    bias = routed.gate.bias[...] if routed.gate.bias is not None else jnp.zeros((num_experts,), jnp.float32)
    up = (
        {FUSED_UP: routed.wi[...]}
        if routed.config.prefuse_moe_weights
        else {"wi_0": routed.wi_0[...], "wi_1": routed.wi_1[...]}
    )
    return {"gate": {"kernel": routed.gate.kernel[...], "bias": bias}, **up, "wo": routed.wo[...]}


def exchange_impl(mesh: Mesh, settings: MoeSettings) -> Impl:
    """The EP exchange (`moe.exchange`, `MoeSettings.exchange_impl`), refused on a mesh that is not all GPUs
    when it is "ragged_all_to_all" (XLA:CPU does not implement it) or "nccl_ep" (NCCL's); see
    `exchange._dense_ragged_all_to_all` for why "auto" is XLA's dense all-to-all, and docs/PERFORMANCE.md."""
    if settings.exchange in GPU_EXCHANGES and not all(d.platform == "gpu" for d in mesh.devices.flat):
        raise UserError(
            f"moe.exchange {settings.exchange} needs GPUs (XLA:CPU has no ragged all-to-all, NCCL EP is NCCL's).",
            key="moe.exchange",
            fix="use moe.exchange: auto.",
        )
    return settings.exchange_impl


def _expert_parallel(
    routed: mt_moe.RoutedMoE, params: Params, x: jax.Array, cfg: MoEConfig, settings: MoeSettings, path: ExpertPath
) -> tuple[jax.Array, Routing]:
    """The routed experts over MaxText's mesh through our dispatch: (float32 [tokens, D], routing), with the
    token sharding MaxText's `sparse_matmul` gives its MoE input, its `ragged_buffer_factor`, and the expert
    weights entering as MaxText stores them (gathered inside, see `expert_parallel.expert_gathers`)."""
    batch_axis = "activation_batch" if x.shape[0] > 1 else "decode_batch_moe"  # as `is_batch_sharded_by_ep`
    spec = routed._logical_to_mesh_axes((batch_axis, "activation_norm_length", None))
    path = dataclasses.replace(path, exchange=exchange_impl(routed.mesh, settings), axis_name=EP_AXIS)
    expert_specs = {
        n: routed._logical_to_mesh_axes(routed.wo_kernel_axes if n == "wo" else routed.wi_kernel_axes)
        for n in expert_keys(params)
    }
    out, routing = expert_parallel.ep_routed_sharded(
        params,
        x,
        cfg,
        routed.mesh,
        token_spec=spec,
        path=path,
        check_vma=bool(routed.config.check_vma),
        expert_specs=expert_specs,
    )
    return out.reshape(-1, cfg.emb_dim), routing


def _load_balance_loss(
    routed: mt_moe.RoutedMoE, params: Params, tokens: jax.Array, shape: tuple[int, ...], routing: Routing
) -> jax.Array | None:
    """MaxText's load-balance loss (its own methods, chosen as `RoutedMoE` chooses) on our routing; None
    when `load_balance_loss_weight` is 0, as MaxText returns."""
    config = routed.config
    if config.load_balance_loss_weight <= 0.0:
        return None
    batch, seq = shape[0], shape[1]
    scores = jax.nn.sigmoid(gate_logits(tokens, params["gate"]["kernel"])).reshape(batch, seq, -1)
    if mt_moe.uses_megatron_seq_aux_loss(config):
        return routed.megatron_seq_aux_loss(scores)
    probs = jax.nn.softmax(scores, axis=-1).astype(routed.dtype)
    return routed.load_balance_loss(routing.indices.reshape(batch, seq, -1), probs)


def _sequence_balance_loss(
    params: Params, tokens: jax.Array, shape: tuple[int, ...], routing: Routing, weight: float
) -> jax.Array | None:
    """DeepSeek-V3's sequence-wise balance loss of this layer (`balance.sequence_balance_loss`), or None when
    `moe.seq_balance_loss_weight` is 0. The unbiased scores are the gate's, recomputed from its kernel as
    `_load_balance_loss` does, outside any expert-parallel shard_map: the per-sequence sums run over whole
    sequences however the tokens are sharded, and the gradient reaches the gate kernel."""
    if weight <= 0.0:
        return None
    batch, seq = shape[0], shape[1]
    scores = jax.nn.sigmoid(gate_logits(tokens, params["gate"]["kernel"])).reshape(batch, seq, -1)
    return balance.sequence_balance_loss(scores, routing.indices.shape[-1], weight)


def _bias_update(config: Any, routing: Routing) -> jax.Array | None:
    """What MaxText's loop adds to the gate bias after the step: rate * sign(mean load - load) per expert, or,
    under gradient accumulation, the raw counts (the loop sums them over micro-batches, then takes the sign)."""
    if not (config.routed_bias and config.routed_bias_update_rate > 0.0):
        return None
    if config.gradient_accumulation_steps > 1:
        return routing.counts
    return mt_moe.load_balance_updates_from_counts(routing.counts, config.num_experts, config.routed_bias_update_rate)


def install(settings: MoeSettings) -> type[OurDeepSeekMoELayer]:
    """Make every DeepSeek decoder MaxText builds from now on in this process run our routed experts, as
    `settings` (the recipe's `moe` section, impl "ours") says; returns the layer class MaxText will build.

    A fresh subclass per call carries the settings (see the module docstring). With gemm "te" the TE
    grouped-GEMM path is chosen here, once (it needs the devices up: call this after `jax.distributed` is
    initialised). With exchange "nccl_ep" MaxText's start-up is made to bootstrap NCCL EP for our layers
    (`nccl_ep_bootstrap`), after its mesh exists and before it builds the model.
    """
    if not settings.ours:
        raise UserError(f"deepseek_layer.install is for moe.impl: ours, got {settings.impl!r}.")
    if settings.gemm not in gemm.BACKENDS:
        raise UserError(
            f"unknown grouped-GEMM backend {settings.gemm!r}.",
            key="moe.gemm",
            fix=f"choose one of {', '.join(gemm.BACKENDS)}.",
        )
    if settings.gemm == "te":
        gemm.select_te_grouped_gemm_path(settings.te_gemm_path)
    if settings.exchange == "nccl_ep":
        from maxtext_moe.upstream import nccl_ep_bootstrap

        nccl_ep_bootstrap.install()
    layer = type(OurDeepSeekMoELayer.__name__, (OurDeepSeekMoELayer,), {"settings": settings})
    layer.__qualname__ = OurDeepSeekMoELayer.__qualname__
    deepseek.DeepSeekMoELayer = layer
    log.info(
        "moe.impl=ours: maxtext.models.deepseek.DeepSeekMoELayer -> %s (grouped GEMM %s)",
        layer.__qualname__,
        settings.gemm if settings.fp8 == "none" else f"{settings.gemm}, FP8 {settings.fp8}",
    )
    return layer
