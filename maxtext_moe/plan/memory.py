"""Per-GPU device memory and per-GPU host memory of one training step.

XLA reports memory only after compiling for the target devices (which a planner does not have), and
MaxText's remat policy decides per named tensor whether it is kept in HBM, offloaded to host or
recomputed. This module adds up, per GPU: parameters, gradients and AdamW state at their dtypes and
shardings; the layer inputs and the `device` tensors every layer keeps for the backward pass; one
layer's transient working set (recomputed tensors, their gradients, MoE dispatch buffers); gathered
FSDP (or scan-sliced) layer weights; and logits. Host memory holds the `offload` tensors (and offloaded
optimizer state). Unrolled and scanned layers peak differently (`_unrolled_peak`, `_scanned_peak`); every
constant is checked against the measured proxy peaks and XLA's compiles in tests/unit/test_plan_calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from maxtext_moe.plan.layout import REMAT_TENSORS, Layout
from maxtext_moe.plan.model import Model

GIB = 2**30
# Logits live as the activation dtype, an fp32 copy for the log-softmax, and the fp32 gradient.
LOGIT_FP32_COPIES = 2
# Whole-layer weight copies while a layer runs. FSDP: the gathered layer in use, the next one prefetched and
# the gradient awaiting reduce-scatter. Scanned at FSDP 1 as well: the loop body slices its layer out of the
# stacked weights (a copy), the next iteration's slice is made early, and the layer's gradient is a fresh
# buffer before it is written into the stacked gradient. Three copies put every scanned one-H200 proxy run
# within 6% at batch 2-8 (without them, 7-17% low: 77.8 GiB measured against 65.5 planned at batch 2, full
# remat); unrolled at FSDP 1 the weights are used in place.
LAYER_WEIGHT_COPIES = 3


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


def _working_set(sizes: dict[str, float], placement: dict[str, str]) -> float:
    """Elements per token live while one layer runs backward: the gradient of every tensor, plus the value of
    each tensor recomputed or brought back from host. Under full remat that is two copies of everything; a
    saved tensor is already counted with the saved activations, and an unread one has no value to bring."""
    return sum(sizes.values()) + sum(s for t, s in sizes.items() if placement[t] not in ("device", "unread"))


def keeps_fp8_operands(lay: Layout) -> bool:
    """Whether each MoE layer keeps its FP8 expert operands from the forward pass for the backward
    (`upstream/remat.py`): our block with FP8 experts, under a policy that names the wo output to save on the
    device (which our block never keeps: the operands take its place)."""
    return lay.weights_before_wo and lay.expert_fp8 and "device" in (lay.remat["mlpwo"], lay.remat["moe_mlpwo"])


def fp8_operand_bytes(m: Model, lay: Layout, tokens: float) -> float:
    """Bytes one MoE layer keeps of its FP8 expert operands: the transposed casts of the permuted input and of
    the activation (one byte per element of each routed copy) and of the three local expert weights."""
    rows = tokens * rows_per_token(lay, m)
    weights = 3 * (m.experts // lay.ep) * m.emb * m.moe_mlp
    return (rows * (m.emb + m.moe_mlp) + weights) / lay.tp


UNROLLED_GRADIENTS = "gradients (beyond the activations freed before them)"
TRANSIENT = "logits + loss, or one layer's backward working set (never live together)"
WEIGHT_COPIES = "layer weight copies (scan slice, FSDP gather, layer gradient)"
ACCUMULATED_GRADIENTS = "accumulated gradients (gradient_accumulation_steps > 1)"
SCANNED_EXPERT_COPY = "expert weights laid out for the FSDP gather, kept through the layer loop"
ACCUMULATED_EXPERT_COPY = "expert weights laid out for the FSDP gather, kept through the accumulation loop"


def _layer_has_collectives(lay: Layout) -> bool:
    """Whether a layer's backward ends in a collective (EP all-to-all, FSDP reduce-scatter, TP reduction)."""
    return lay.ep > 1 or lay.fsdp > 1 or lay.tp > 1


def _unrolled_peak(device: dict[str, float], layer_saved: float) -> None:
    """Unrolled layers: the peak is at the start of the backward pass, with every layer's saved tensors live.

    Each layer's saved tensors are their own buffers, freed by that layer's backward as its working set
    grows, so on one GPU a layer's working set reuses the memory of its own saved tensors (`layer_saved`);
    where the layer's backward ends in a collective, the latency-hiding scheduler starts the next layer's
    recompute before that collective is done, and no memory is reused. The logits and their fp32 copies are
    freed once the head's backward is done, before any layer's backward starts: the two never coexist. The
    parameter gradients appear as the activations free, and count only where they (with one layer's working
    set) outgrow them.
    Not read from XLA's buffer assignment; checked against every measured proxy peak
    (tests/unit/test_plan_calibration.py): counting the working set and logits on top of each other and the
    saved tensors put the one-H200 unrolled proxy 17-22% high at batch 8; reusing the layer's saved tensors
    under EP put the two-H200 EP2 proxy 9-11% low (the scheduler explanation is inferred, not read from XLA)."""
    grads = device.pop("gradients")
    working = device.pop("layer working set (recompute + MoE dispatch)")
    logits = device.pop("logits + loss")
    transient = max(logits, working - layer_saved)
    device[TRANSIENT] = transient
    device[UNROLLED_GRADIENTS] = max(0.0, grads + working - device["saved activations (remat policy)"] - transient)


def _scanned_peak(device: dict[str, float], lay: Layout, routed_expert_bytes: float) -> None:
    """Scanned layers: the loop's saved tensors are one stacked buffer, freed after the backward loop, and the
    backward carries the stacked gradients from before its first iteration, so both count in full; the head's
    backward (logits, their fp32 copies and gradient) is done before the backward loop starts, so the logits
    and one layer's backward working set are never live together, as unrolled.

    Read from XLA's buffers (deviceless compile of `deepseek3-671b-h200-128` with scan_layers=true, one
    accumulation step; its HLO dump's live ranges, `python -m maxtext_moe.plan.peak`): the head's
    backward holds the fp32 logits and their gradient (23.7 GiB) beside the state and the stacked layer inputs
    (19.0); the MTP layer's backward then holds the bf16 logits and their gradient (11.8), its own buffers and
    the stacked expert gradients, allocated there (9.5), and no fp32 logits; inside the backward loop one
    layer's recompute, exchange buffers and gathered weights are live beside the bf16 logits' gradient (5.9).
    Counting the logits and the working set on top of each other put the H200 and H100 compiles 18-26% above
    XLA's (one step and accumulated).

    XLA also lays the FSDP-sharded routed expert weights of every layer out for the all-gather (the sharded
    embedding dimension major: bf16[448,58,32,2048] beside the state's [32,58,448,2048]) once, before the
    forward loop, since the stacked weights do not change across its iterations, and keeps them to the end of
    the backward loop (9.5 GiB at every phase of the same dump), as the accumulation loop does for unrolled
    layers. Seen with TE's grouped GEMM; MaxText's block on tokamax at FSDP2 measured without it (the
    two-H200 FSDP proxies, scanned: -8% to +2% of their plan without this term, +4% to +12% with it)."""
    device[TRANSIENT] = max(device.pop("logits + loss"), device.pop("layer working set (recompute + MoE dispatch)"))
    if lay.fsdp > 1 and lay.moe_path == "te":
        device[SCANNED_EXPERT_COPY] = routed_expert_bytes


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
    # Unrolled layers: XLA (JAX 0.11.2) schedules each offloaded tensor's copy to host just before its layer's
    # backward, so the tensor stays in HBM through the rest of the forward as well as going to host memory
    # (deviceless compiles of the GB200 recipe at 5 and 9 layers, docs/PLAN.md: +2.8 GiB per MoE layer against
    # +0.9 with full remat). A scanned loop copies inside its body, which frees the HBM copy.
    in_hbm = ("device",) if lay.scanned else ("device", "offload")
    placement = lay.placement
    saved_dev = saved_host = 0.0
    for moe, n in stage.items():
        sizes = tensor_sizes(m, lay, moe)
        saved_dev += n * (m.emb / lay.tp + sum(s for t, s in sizes.items() if placement[t] in in_hbm))
        saved_host += n * sum(s for t, s in sizes.items() if placement[t] == "offload")
    working = max(_working_set(tensor_sizes(m, lay, moe), placement) for moe in (False, True))
    experts_per_rank = m.experts // lay.ep
    gathered = max(m.layer_weights(moe, experts_per_rank) for moe in (False, True)) / lay.tp
    logits = tokens * m.vocab / lay.tp / lay.vocab_tiling * (act + 4 * LOGIT_FP32_COPIES)

    device = dict(state)
    device["saved activations (remat policy)"] = stage_tokens * saved_dev * act
    if keeps_fp8_operands(lay):
        device["saved activations (remat policy)"] += stage[True] * fp8_operand_bytes(m, lay, stage_tokens)
    device["layer working set (recompute + MoE dispatch)"] = micro_tokens * working * act
    copies = LAYER_WEIGHT_COPIES if lay.fsdp > 1 or lay.scanned else 0
    device[WEIGHT_COPIES] = gathered * lay.weight_bytes * copies
    device["logits + loss"] = logits
    routed_expert_bytes = m.routed_expert_params / (shard * lay.pp) * lay.weight_bytes
    if lay.scanned:
        _scanned_peak(device, lay, routed_expert_bytes)
    else:
        moe_saved = m.emb / lay.tp + sum(s for t, s in tensor_sizes(m, lay, True).items() if placement[t] == "device")
        layer_saved = 0.0 if _layer_has_collectives(lay) else micro_tokens * moe_saved * act
        _unrolled_peak(device, layer_saved)
    if lay.grad_accum > 1:
        # MaxText's accumulation loop (`gradient_accumulation_loss_and_grad`) carries the summed gradients, at the
        # parameters' dtype and sharding, through every micro-batch beside the gradients the micro-batch makes.
        device[ACCUMULATED_GRADIENTS] = params * lay.weight_bytes
        if lay.fsdp > 1 and not lay.scanned:
            # XLA:GPU (JAX 0.11.2) reads each layer's FSDP-sharded routed expert weights into the all-gather in
            # another layout (the gathered dimension major). In one step it re-lays one layer's weights before
            # its gather; the weights are the same in every micro-batch, so in the accumulation loop it does it
            # once, before the loop, and keeps every layer's copy through it (deviceless compile of the H200
            # recipe's 5 layers: the peak holds the 9 expert matrices' transposes, 0.49 GiB).
            device[ACCUMULATED_EXPERT_COPY] = routed_expert_bytes
    if saved_host:
        host["offloaded activations"] = stage_tokens * saved_host * act
    return Memory(device=device, host=host)
