"""Per-layer MoE load balance in MaxText's step metrics (TensorBoard and metrics.jsonl).

The gap: MaxText 0.2.5's training step turns a layer's sown intermediates into scalars only for names it
knows: `moe_lb_loss`, `moe_max_load_ratio` (one figure over all layers, and its config refuses it outside
the ring-of-experts path), and per-layer activation statistics through `record_activation_metrics` when
`record_internal_nn_metrics` is set. No expert load, bias or drop count per layer, and MaxText's own block
never hands out its expert counts. Three touches, each the smallest that reaches:

- The DeepSeek MoE layer sows `moe_balance_<stat>` (`moe.balance` names the stats) from the routing it
  used: our layer from its own (`deepseek_layer`), MaxText's block from its own gate and
  `RoutedMoE.get_topk` re-run on the layer input (`CountedDeepSeekMoELayer`, what `install_counted_layer`
  makes MaxText build for `moe.impl: maxtext`). MaxText's block does not say what its experts computed, so
  it has no `dropped`.
- `train.record_activation_metrics`, the one MaxText function that receives a step's intermediates and its
  scalars, is rebound to add `moe/<stat>/<layer>` and then run MaxText's own.
- `train.train_step` is wrapped to pass a view of the config with `record_internal_nn_metrics` on, so that
  the step calls that function. The model keeps the real config: the layers sow MaxText's activation
  statistics only when the recipe asks for them.

Layers are labelled as MaxText labels its activation scalars, `layer_NNN` by decoder layer (dense layers
count), and `mtp_N` for the multi-token-prediction layers; layers elsewhere (pipeline stages, engram chunks) by
their path in the model. Scanned and unrolled decoders both work: a
scanned stack sows one value per layer, stacked; an unrolled one one value per layer object.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from maxtext.models import deepseek

from maxtext_moe.moe import balance

PREFIX = "moe_balance_"
_MTP = re.compile(r"mtp_layer_(\d+)")
_MOE_STACK = re.compile(r"moe_layers(?:_(\d+))?")  # scanned ("moe_layers") or unrolled ("moe_layers_3")


def sow(
    layer: nnx.Module,
    counts: jax.Array,
    dropped: jax.Array | None,
    bias: jax.Array | None,
    seq_loss: jax.Array | None = None,
) -> None:
    """Sow one MoE layer's load, drop count (when the layer measured it), selection-bias statistics and its
    weighted sequence-wise balance loss (when it computes one: its share of MaxText's `learning/moe_lb_loss`)."""
    stats = balance.load_stats(counts)
    if dropped is not None:
        stats[balance.DROPPED] = dropped
    if seq_loss is not None:
        stats[balance.SEQ_BALANCE_LOSS] = seq_loss
    if bias is not None:
        stats |= balance.bias_stats(bias)
    for name, value in stats.items():
        layer.sow(nnx.Intermediate, PREFIX + name, value)


class CountedDeepSeekMoELayer(deepseek.DeepSeekMoELayer):
    """MaxText's DeepSeek MoE layer, unchanged, that also sows its load balance: the routing is MaxText's
    own gate and top-k on the same input (the gate matmul is the same expression as the block's, one top-k
    over [tokens, experts] is the extra work)."""

    def mlp_op(self, x: jax.Array, deterministic: bool, *args: Any, **kwargs: Any):
        out = super().mlp_op(x, deterministic, *args, **kwargs)
        routed = self.DeepSeekMoeBlock_0.MoeBlock_0
        logits, pre_bias = routed.gate(x.astype(self.config.dtype))
        _, indices = routed.get_topk(logits, pre_bias)
        counts = jnp.bincount(indices.reshape(-1), length=routed.num_experts)
        sow(self, counts, None, routed.gate.bias[...] if routed.gate.bias is not None else None)
        return out


def install_counted_layer() -> type[CountedDeepSeekMoELayer]:
    """Make the DeepSeek decoders MaxText builds from now on sow their load balance with MaxText's own block
    (`moe.impl: maxtext`; `deepseek_layer.install` does it for ours)."""
    deepseek.DeepSeekMoELayer = CountedDeepSeekMoELayer
    return CountedDeepSeekMoELayer


def _labels(keys: tuple[str, ...], n: int, first_dense: int) -> list[str]:
    """Labels of the `n` layers whose values sit at path `keys` in the step's intermediates."""
    for k in keys:
        if m := _MTP.fullmatch(k):
            return [f"mtp_{int(m.group(1)) + i}" for i in range(n)]
    for k in keys:
        if m := _MOE_STACK.fullmatch(k):
            start = first_dense + int(m.group(1) or 0)
            return [f"layer_{start + i:03d}" for i in range(n)]
    # Elsewhere (pipeline stages, engram chunks): the path itself, so that a metric never stops a run.
    return ["-".join(keys) + (f"_{i}" if n > 1 else "") for i in range(n)]


def layer_scalars(intermediates: Mapping[str, Any], first_dense: int, microbatches: int = 1) -> dict[str, jax.Array]:
    """`moe/<stat>/<layer>` for every `moe_balance_<stat>` the layers sowed. Under gradient accumulation
    MaxText sums the intermediates of the step's `microbatches`; the scalars are then their mean (each
    statistic is per micro-batch, averaged)."""
    out: dict[str, jax.Array] = {}
    for path, value in jax.tree_util.tree_leaves_with_path(intermediates):
        keys = tuple(str(k.key) for k in path if hasattr(k, "key"))
        if not keys or not keys[-1].startswith(PREFIX):
            continue
        values = jnp.ravel(value) / microbatches
        for i, label in enumerate(_labels(keys[:-1], values.shape[0], first_dense)):
            out[f"moe/{keys[-1].removeprefix(PREFIX)}/{label}"] = values[i]
    return out


class _Recording:
    """The step's view of MaxText's config: the same values, with `record_internal_nn_metrics` on."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return True if name == "record_internal_nn_metrics" else getattr(self._config, name)


def install() -> None:
    """Add the per-layer balance scalars to every training step MaxText runs from now on in this process."""
    from maxtext.trainers.pre_train import train

    record: Callable[..., None] = getattr(train.record_activation_metrics, "maxtext_original", None) or (
        train.record_activation_metrics
    )
    step: Callable[..., Any] = getattr(train.train_step, "maxtext_original", None) or train.train_step

    def record_with_balance(metrics: dict, intermediates: Any, config: Any) -> None:
        metrics["scalar"].update(
            layer_scalars(intermediates, config.first_num_dense_layers, config.gradient_accumulation_steps)
        )
        record(metrics, intermediates, config)

    @functools.wraps(step)
    def train_step(model: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        return step(model, _Recording(config), *args, **kwargs)

    record_with_balance.maxtext_original = record  # type: ignore[attr-defined]
    train_step.maxtext_original = step  # type: ignore[attr-defined]
    train.record_activation_metrics = record_with_balance
    train.train_step = train_step
