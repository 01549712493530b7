"""Per-GPU device memory and per-GPU host memory of one training step.

XLA reports memory only after compiling for the target devices (which a planner does not have), and
MaxText's remat policy decides per named tensor whether it is kept in HBM, offloaded to host or
recomputed. This module adds up, per GPU: parameters, gradients and AdamW state at their dtypes and
shardings; the layer inputs and the `device` tensors every layer keeps for the backward pass; one
layer's transient working set (recomputed tensors, their gradients, MoE dispatch buffers); gathered
FSDP weights; and logits. Host memory holds the `offload` tensors (and offloaded optimizer state).
"""

from __future__ import annotations

from dataclasses import dataclass

from maxtext_moe.plan.layout import REMAT_TENSORS, Layout
from maxtext_moe.plan.model import Model

GIB = 2**30
# Logits live as the activation dtype, an fp32 copy for the log-softmax, and the fp32 gradient.
LOGIT_FP32_COPIES = 2
# Gathered FSDP weights: the layer in use, the next one prefetched, and the gradient awaiting reduce-scatter.
GATHERED_LAYER_COPIES = 3


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU (device) and per GPU of host memory, by consumer."""

    device: dict[str, float]
    host: dict[str, float]

    @property
    def device_total(self) -> float:
        return sum(self.device.values())

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    def largest(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.device.items(), key=lambda kv: -kv[1])[:n]


def rows_per_token(lay: Layout, m: Model) -> float:
    """Routed rows one device's expert buffers hold per local token.

    Dropless with ragged_buffer_factor=-1 sizes the receive buffer for the worst case (every token
    of every EP peer lands here: ep x top-k); a positive factor sizes it at factor x balanced load.
    """
    factor = lay.ragged_buffer_factor if lay.ragged_buffer_factor > 0 else lay.ep
    return m.topk * factor


def tensor_sizes(m: Model, lay: Layout, moe: bool) -> dict[str, float]:
    """Elements per local token of each remat-named tensor of one dense or MoE layer."""
    qk, v = m.heads * (m.qk_nope + m.qk_rope), m.heads * m.v_head
    ffn = m.shared * m.moe_mlp if moe else m.mlp
    rows = rows_per_token(lay, m) if moe else 0.0
    sizes = {
        "context": v,
        "attention_out": v,
        "query_proj": qk,
        "key_proj": qk,
        "value_proj": v,
        "out_proj": m.emb,
        "query_wa_proj": m.q_lora,
        "mla_q": m.q_lora,
        "kv_wa_proj": m.kv_lora + m.qk_rope,
        "mla_kv": m.kv_lora + m.qk_rope,
        "mlpwi_0": ffn,
        "mlpwi_1": ffn,
        "mlpwo": m.emb,
        "moe_mlpwi_0": rows * m.moe_mlp,
        "moe_mlpwi_1": rows * m.moe_mlp,
        "moe_mlpwo": rows * m.emb,
        "moe_x_sorted": rows * m.emb,
    }
    assert set(sizes) == set(REMAT_TENSORS)
    return {k: s / lay.tp for k, s in sizes.items()}


def _working_set(sizes: dict[str, float], remat: dict[str, str]) -> float:
    """Elements per token live while one layer runs backward: the gradient of every tensor, plus the value of
    each tensor not kept in HBM (recomputed, or brought back from host). Under full remat that is two
    copies of everything; a saved tensor is already counted with the saved activations."""
    return sum(sizes.values()) + sum(s for t, s in sizes.items() if remat[t] != "device")


UNROLLED_GRADIENTS = "gradients (beyond the activations freed before them)"


def _gradients_fill_as_activations_free(device: dict[str, float]) -> None:
    """Unrolled layers: each layer's saved tensors can be freed during that layer's backward, as its parameter
    gradients appear, so the peak can come at the start of the backward, before any gradient exists; the
    gradients count only where they outgrow the activations. Scanned, the backward loop carries the stacked
    gradients of every layer from its first iteration, next to the saved tensors: counted in full.
    Not read from XLA's buffer assignment; fitted to measured peaks (docs/PLAN.md): unrolled, counting the
    gradients in full put the one-H200 proxy 29-30% high and the two-H200 EP2 proxy 17-20% high."""
    grads = device.pop("gradients")
    activations = sum(
        device[k]
        for k in ("saved activations (remat policy)", "layer working set (recompute + MoE dispatch)", "logits + loss")
    )
    device[UNROLLED_GRADIENTS] = max(0.0, grads - activations)


def per_gpu(m: Model, lay: Layout) -> Memory:
    """Memory of one GPU under `lay` (the most loaded pipeline stage: it also holds embedding and head)."""
    shard = lay.fsdp * lay.ep * lay.tp
    embed = 2 * m.emb * m.vocab
    params = m.routed_expert_params / (shard * lay.pp) + (m.other_params - embed) / (shard * lay.pp) + embed / shard
    nu_bytes = lay.weight_bytes
    state = {
        "parameters": params * lay.weight_bytes,
        "gradients": params * lay.weight_bytes,
        "optimizer state (AdamW mu, nu)": params * (lay.mu_bytes + nu_bytes),
    }
    host: dict[str, float] = {}
    if lay.offload_optimizer:
        host["optimizer state (AdamW mu, nu)"] = state.pop("optimizer state (AdamW mu, nu)")
    if lay.offload_params:
        host["parameters"] = state.pop("parameters")

    # With PP a stage runs every microbatch of its data-parallel group (pp x the per-device batch) through
    # L/pp layers and keeps their saved tensors until their backward; it recomputes one microbatch at a time.
    tokens, act = lay.pass_tokens, lay.act_bytes
    stage_tokens, micro_tokens = tokens * lay.pp, tokens * lay.pp / lay.microbatches
    layers_here = {False: m.dense_layers, True: m.moe_layers + m.mtp_layers}
    stage = {kind: n / lay.pp for kind, n in layers_here.items()}
    saved_dev = saved_host = 0.0
    for moe, n in stage.items():
        sizes = tensor_sizes(m, lay, moe)
        saved_dev += n * (m.emb / lay.tp + sum(s for t, s in sizes.items() if lay.remat[t] == "device"))
        saved_host += n * sum(s for t, s in sizes.items() if lay.remat[t] == "offload")
    working = max(_working_set(tensor_sizes(m, lay, moe), lay.remat) for moe in (False, True))
    experts_per_rank = m.experts // lay.ep
    gathered = max(m.layer_weights(moe, experts_per_rank) for moe in (False, True)) / lay.tp
    logits = tokens * m.vocab / lay.tp / lay.vocab_tiling * (act + 4 * LOGIT_FP32_COPIES)

    device = dict(state)
    device["saved activations (remat policy)"] = stage_tokens * saved_dev * act
    device["layer working set (recompute + MoE dispatch)"] = micro_tokens * working * act
    device["gathered FSDP weights"] = gathered * lay.weight_bytes * GATHERED_LAYER_COPIES if lay.fsdp > 1 else 0.0
    device["logits + loss"] = logits
    if not lay.scanned:
        _gradients_fill_as_activations_free(device)
    if saved_host:
        host["offloaded activations"] = stage_tokens * saved_host * act
    return Memory(device=device, host=host)
