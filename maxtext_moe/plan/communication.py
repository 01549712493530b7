"""Bytes each GPU moves per training step, by collective, and how long that takes on the profile.

MaxText's XLA path sends a routed token once per chosen expert, so
the EP all-to-all volume grows with top-k; with per-rank dedup (our block, `moe.impl: ours`) it grows
with the number of distinct ranks a token reaches, which group-limited routing caps. Upstream reports
neither; both are here. Over XLA's plain all-to-all (our default `moe.exchange`) the wire carries a
block of T rows to every peer whatever the routing needs: EP - 1 rows per token, the third figure. The
step time uses what the recipe's block and exchange send.
Which link a collective uses follows MaxText's mesh order (expert innermost, then tensor, fsdp,
stage, data): an axis whose group spans more GPUs than one NVLink domain runs at network speed.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb

from maxtext_moe.plan.layout import Layout
from maxtext_moe.plan.memory import per_gpu
from maxtext_moe.plan.model import Model

# Of the host offload's transfer time, the share the step showed although compute could cover it: on one H200
# (PCIe), the scanned proxy at batch 3 with the MoE up-projection offloaded took 0.853 s a step against 0.794 s
# with it saved in HBM under the same remat policy, 0.059 s of the 0.242 s the transfer takes at the planner's
# link rate (proxy_h200_1gpu_2026-12-04_scanned_b3_{offload,saved}_moe_up.json). The copies to and from the
# host wait on the layer whose tensors they carry, so part of each is on the step's critical path.
HOST_OFFLOAD_EXPOSED_SHARE = 0.245


@dataclass(frozen=True)
class Collective:
    name: str
    bytes: float  # sent (or received) per GPU per step
    gbps: float  # link bandwidth it runs at, GB/s per direction
    overlapped: bool  # hidden behind compute by the latency-hiding scheduler
    exposed_share: float = 0.0  # of an overlapped collective's time, the share measured to show in the step anyway

    @property
    def seconds(self) -> float:
        return self.bytes / (self.gbps * 1e9) if self.bytes else 0.0


def distinct_ranks(experts: int, topk: int, ranks: int) -> float:
    """Expected distinct EP ranks among `topk` experts drawn uniformly from `experts` spread over `ranks`."""
    per_rank = experts // ranks
    return ranks * (1 - comb(experts - per_rank, topk) / comb(experts, topk))


def ranks_per_token(m: Model, lay: Layout, groups: int, topk_groups: int) -> float:
    """Distinct ranks per token; group-limited routing with groups aligned to ranks narrows the draw."""
    if groups > 0 and lay.ep % groups == 0:
        ranks = topk_groups * lay.ep // groups
        return distinct_ranks(m.experts * topk_groups // groups, m.topk, ranks)
    return distinct_ranks(m.experts, m.topk, lay.ep)


def _link(lay: Layout, stride: int, size: int) -> float:
    hw = lay.hardware
    return hw.intra_node_gbps if stride * size <= hw.nvlink_domain else hw.inter_node_gbps


def per_step(m: Model, lay: Layout, groups: int = 0, topk_groups: int = 0) -> tuple[list[Collective], dict[str, float]]:
    """Collectives of one step per GPU, plus the EP all-to-all volume: once per expert, once per rank, and
    in dense blocks (see the module docstring)."""
    wb = lay.weight_bytes
    # Strides in MaxText's mesh order (innermost first: expert, tensor, fsdp, stage, data).
    s_ep, s_tp = 1, lay.ep
    s_fsdp = lay.ep * lay.tp
    s_pp = s_fsdp * lay.fsdp
    s_dp = s_pp * lay.pp
    embed = 2 * m.emb * m.vocab
    dense = ((m.other_params - embed) / lay.pp + embed) / lay.tp  # gathered over fsdp x ep
    experts = m.routed_expert_params / (lay.ep * lay.tp * lay.pp)  # gathered over fsdp
    g_dense, g_exp = lay.fsdp * lay.ep, lay.fsdp
    gather = (dense * (g_dense - 1) / g_dense + experts * (g_exp - 1) / g_exp) * wb
    fsdp_gbps = _link(lay, s_fsdp, lay.fsdp) if lay.fsdp > 1 else _link(lay, s_ep, lay.ep)
    out = [
        # Weights gathered for the forward and again for the recomputing backward; gradients reduce-scattered.
        Collective("FSDP all-gather (fwd + bwd)", 2 * gather * lay.grad_accum, fsdp_gbps, lay.latency_hiding),
        Collective("FSDP reduce-scatter (grads)", gather * lay.grad_accum, fsdp_gbps, lay.latency_hiding),
    ]
    if lay.dp > 1:
        shard = (m.total_params / (lay.fsdp * lay.ep * lay.tp * lay.pp)) * wb
        out.append(
            Collective(
                "DP all-reduce (grads)", 2 * shard * (lay.dp - 1) / lay.dp, _link(lay, s_dp, lay.dp), lay.latency_hiding
            )
        )
    a2a = {"per_expert": 0.0, "per_rank_dedup": 0.0, "dense_blocks": 0.0}
    if lay.ep > 1:
        moe_layers = (m.moe_layers + m.mtp_layers) / lay.pp
        # dispatch + combine in the forward, again when the layer is recomputed, and their transposes.
        passes = 4 + (2 if lay.remat["moe_x_sorted"] == "remat" else 0)
        remote = (lay.ep - 1) / lay.ep
        per_token = moe_layers * passes * m.emb * lay.act_bytes * remote * lay.pp
        a2a["per_expert"] = lay.tokens * per_token * m.topk
        a2a["per_rank_dedup"] = lay.tokens * per_token * ranks_per_token(m, lay, groups, topk_groups)
        a2a["dense_blocks"] = lay.tokens * per_token * lay.ep  # (EP - 1) rows per token
        if lay.dense_exchange:
            name, sent = "EP all-to-all (dispatch + combine, a block of T rows per peer)", a2a["dense_blocks"]
        elif lay.dedup_dispatch:
            name, sent = "EP all-to-all (dispatch + combine, once per rank)", a2a["per_rank_dedup"]
        else:
            name, sent = "EP all-to-all (dispatch + combine)", a2a["per_expert"]
        out.append(Collective(name, sent, _link(lay, s_ep, lay.ep), False))
    if lay.tp > 1:
        layers = (m.layers + m.mtp_layers) / lay.pp
        out.append(
            Collective(
                "TP all-reduce (activations)",
                lay.tokens * layers * 4 * 2 * m.emb * lay.act_bytes,
                _link(lay, s_tp, lay.tp),
                False,
            )
        )
    if lay.pp > 1:
        out.append(
            Collective(
                "PP send/recv (activations)",
                2 * lay.tokens * lay.pp * m.emb * lay.act_bytes,
                _link(lay, s_pp, lay.pp),
                False,
            )
        )
    offloaded = per_gpu(m, lay).host.get("offloaded activations", 0.0)
    if offloaded:
        out.append(
            Collective(
                "host offload (out + back)",
                2 * offloaded * lay.grad_accum,
                lay.hardware.host_link_gbps,
                True,
                HOST_OFFLOAD_EXPOSED_SHARE,
            )
        )
    return out, a2a
