"""Step time, TFLOPS/GPU and the fit verdict of one layout; text and JSON rendering.

The step time is a sum of physical terms, each priced by a constant calibrated on the H200 proxy runs in
docs/results (every constant below names its measurement): dense GEMMs, the routed experts' grouped GEMM
(empty receive slots included), flash attention, each at its rate inside a real step (profiles, not single
kernels); FP8 quantization; the MoE block's routing/permute/unpermute per routed copy; the per-step
optimizer update per parameter a GPU holds; exposed collectives at the link bandwidth they reach.
Recomputation under remat is priced by the kernel it reruns. Other profiles and FP8 are assumed to reach
the same fraction of their own peak. Collectives the latency-hiding scheduler can overlap cost only what
exceeds compute; the EP all-to-all sits on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.plan import communication, compile_time, flops, layout, memory
from maxtext_moe.plan.layout import Layout
from maxtext_moe.plan.model import Model
from maxtext_moe.recipe.resolved import ResolvedRecipe

GIB = 2**30
# cuBLAS GEMMs: a measured 8192^3 BF16 matmul (790 TFLOP/s); the proxy profiles' cuBLAS time agrees within
# 10% (proxy_h200_1gpu_run4_ours_full_profile_summary.json, run5_ours_b4_minimal_scanned_profile.json).
DENSE_GEMM_EFFICIENCY = 790 / 989
# The same GEMMs in FP8 through TE (`quantization=te_fp8_currentscaling`) reach a smaller share of the FP8
# peak: 1.03e3 TFLOP/s in the profile of our block with FP8 experts and dense layers on one H200
# (proxy_h200_1gpu_2026-12-01_eve_profile_fp8_dense_te_b6.json), 330.6 ms a step where BF16 took 473.
DENSE_FP8_GEMM_EFFICIENCY = 1030 / 1979
# Routed experts' grouped GEMM inside a step. TE: its kernel time in the two one-GPU profiles above (189 ms
# and 363 ms per step for 93 and 187 ms of work at peak: 0.49-0.51), below the 637/989 it reaches alone
# (benchmarks/bench_moe_layer.py). tokamax and ragged_dot: alone (docs/PERFORMANCE.md); with tokamax,
# MaxText's block on one GPU and over FSDP2 comes within 10% (its EP2 rungs do not: the test's known gaps).
GROUPED_GEMM_EFFICIENCY = {"te": 0.50, "tokamax": 276 / 989, "ragged_dot": 23 / 989, "dense": 790 / 989}
# cuDNN flash attention forward + backward (+ its forward rerun when recomputed): the same two profiles,
# 64 ms and 142 ms per step for 28 and 56 ms of work at peak (0.43 and 0.39).
ATTENTION_EFFICIENCY = 0.41
# The constants from here on are fitted together (least squares of the relative error, the rates above held)
# to the median steps of every proxy rung tests/unit/test_plan_calibration.py holds (docs/results/proxy_*.json).
# An empty receive slot in our EP block's TE buffer (expert_rows_computed) costs this fraction of a routed
# row: set by the EP2 rungs at ragged_buffer_factor -1, 1.25 and 1.1 (proxy_h200_2gpu_run1[0-3]_*.json).
EMPTY_ROW_COST = 0.79
# FP8 expert GEMMs: seconds per element of the tensors quantized per routed copy (input and hidden
# activation forward, their gradients backward, and the forward's two again in the backward pass unless the
# layer keeps its FP8 operands, `memory.keeps_fp8_operands`: 3 x (emb + moe_mlp), or 2 x); TE's unfused
# cast/transpose passes. Fitted as 1.0e-11 an element of 2 x (emb + moe_mlp) on rungs that all cast again in
# the backward pass; that is 6.7e-12 an element of the 3 x they cast.
# Set by every FP8 rung (proxy_h200_1gpu_*fp8*.json, 2gpu_run9_*fp8*), refitted with the four rungs of the
# scatter-free group scales (upstream/te_group_scales.py; proxy_h200_1gpu_2026-12-01_night_*.json, planned
# 8-9% slow at 1.2e-11). Rungs recorded before them paid TE's per-group amax scatters in some calls (up to 135
# ms a step, docs/PERFORMANCE.md) and planned 1-3% fast at 1.2e-11; this value minimises the squared relative
# error over all rungs.
QUANTIZE_S_PER_ELEMENT = 1.0e-11 * 2 / 3
# Routing, permute and unpermute (sort, gather, scatter, top-k) per routed (token, expert) copy per MoE
# layer, by block: MaxText's sparse_matmul sorts and scatters through XLA, ours runs its own permutation.
# TE's block (`te_moe_block`, no proxy rung) permutes in TE's fused kernels and is priced as ours. The
# profiles' "other" kernels (123 ms per step at batch 4, run5 profile) hold this, norms and the optimizer.
PERMUTE_S_PER_COPY = {"ours": 7.7e-8, "maxtext": 4.6e-7}
# The per-step work that does not grow with tokens (AdamW update, gradient clipping) per parameter a GPU
# holds: set by the rungs at batch 2-8 (docs/PERFORMANCE.md: batch 8 gains 3.6% per token over batch 4).
STEP_S_PER_PARAM = 8.1e-12
# Collectives over NVLink and host transfers reach this fraction of the link's nominal bandwidth: set by the
# EP2 and FSDP2 rungs (proxy_h200_2gpu_*.json) and the host-offloaded one (proxy_h200_1gpu_*_offloaded.json).
# No multi-node run has been measured: the network's rate is taken as the profile states it.
LINK_EFFICIENCY = 0.52


@dataclass(frozen=True)
class Plan:
    recipe: str
    model: Model
    layout: Layout
    flops: flops.Flops
    memory: memory.Memory
    collectives: list[communication.Collective]
    a2a: dict[str, float]
    compute_s: float
    recompute_fraction: float
    bubble: float
    terms: dict[str, float]  # seconds a step by kind of work: compute, then exposed collectives

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return (
            self.memory.device_total <= self.layout.usable_gib * GIB
            and self.memory.host_total <= self.layout.hardware.host_mem_gb * 1e9
        )

    @property
    def tflops_per_gpu(self) -> float:
        return self.flops.total * self.layout.tokens / self.step_s / 1e12

    def to_json(self) -> dict[str, Any]:
        lay, mem = self.layout, self.memory
        return {
            "recipe": self.recipe,
            "layout": lay.describe(),
            "fits": self.fits,
            "memory_per_gpu_gib": mem.device_total / GIB,
            "usable_gib": lay.usable_gib,
            "memory_breakdown_gib": {k: v / GIB for k, v in mem.device.items()},
            "host_memory_per_gpu_gib": mem.host_total / GIB,
            "host_breakdown_gib": {k: v / GIB for k, v in mem.host.items()},
            "params_billion": self.model.total_params / 1e9,
            "mtp_layers": self.model.mtp_layers,
            "gflops_per_token": self.flops.total / 1e9,
            "gflops_per_token_maxtext": self.flops.maxtext / 1e9,
            "gflops_per_token_without_mtp": self.flops.without_mtp / 1e9,
            "communication_gib_per_step": {c.name: c.bytes / GIB for c in self.collectives},
            "ep_all_to_all_gib": {k: v / GIB for k, v in self.a2a.items()},
            "expert_rows_computed_per_copy": expert_rows_computed(self.model, lay),
            "compute_s": self.compute_s,
            "recompute_fraction": self.recompute_fraction,
            "pipeline_bubble": self.bubble,
            "step_time_s": self.step_s,
            "step_terms_s": dict(self.terms),
            "tokens_per_s_per_gpu": lay.tokens / self.step_s,
            "predicted_tflops_per_gpu": self.tflops_per_gpu,
            "compile_s_deviceless_2_cores": compile_time.seconds(self.model, lay),
        }

    def render(self) -> str:
        lay, mem, m, f = self.layout, self.memory, self.model, self.flops
        verdict = "fits" if self.fits else "does not fit"
        top = ", ".join(f"{k} {v / GIB:.1f}" for k, v in mem.largest())
        lines = [
            f"plan {self.recipe}: {lay.describe()}",
            f"  model: {m.total_params / 1e9:.1f}B parameters ({m.main_params / 1e9:.1f}B without MTP), "
            f"{m.layers} layers ({m.dense_layers} dense), {m.experts} experts top-{m.topk}, MTP layers {m.mtp_layers}",
            f"  FLOPs/token: {f.total / 1e9:.1f} GFLOP (MTP {'in' if m.mtp_layers else 'out'}; MaxText's count "
            f"{f.maxtext / 1e9:.1f}; without MTP {f.without_mtp / 1e9:.1f}); seq {lay.seq}",
            f"  memory/GPU: {mem.device_total / GIB:.1f} GiB of {lay.usable_gib:.1f} GiB usable "
            f"({lay.hardware.cuda_memory_gib:.1f} GiB x {lay.mem_fraction:g}) -> {verdict}",
            f"    largest: {top} (GiB)",
        ]
        lines += [f"    {k}: {v / GIB:.2f} GiB" for k, v in mem.device.items()]
        lines.append(
            f"  host memory/GPU: {mem.host_total / GIB:.1f} GiB of {lay.hardware.host_mem_gb:g} GB"
            + "".join(f"; {k} {v / GIB:.1f} GiB" for k, v in mem.host.items())
        )
        lines.append("  communication/GPU/step:")
        for c in self.collectives:
            lines.append(
                f"    {c.name}: {c.bytes / GIB:.1f} GiB at {c.gbps:g} GB/s = {c.seconds:.2f} s"
                + (f", {_seconds(c, lay):.2f} s at the {LINK_EFFICIENCY:.0%} of it measured" if c.exposed_share else "")
                + (f" ({c.exposed_share:.0%} of that exposed, the rest overlapped)" if c.exposed_share else "")
                + (" (overlapped)" if c.overlapped and not c.exposed_share else "")
            )
        if self.a2a["per_expert"]:
            lines.append(
                f"    EP all-to-all once per expert {self.a2a['per_expert'] / GIB:.1f} GiB; "
                f"with per-rank dedup {self.a2a['per_rank_dedup'] / GIB:.1f} GiB; "
                f"in dense blocks {self.a2a['dense_blocks'] / GIB:.1f} GiB"
            )
        rows = expert_rows_computed(m, lay)
        if rows > 1:
            lines.append(
                f"    expert GEMMs run {rows:g}x the routed rows: empty receive slots count on TE "
                f"(ragged_buffer_factor {lay.ragged_buffer_factor:g})"
            )
        peak = "FP8" if lay.dense_fp8 or lay.expert_fp8 else "BF16"
        lines.append(
            f"  step: compute {self.compute_s:.2f} s (recompute +{self.recompute_fraction:.0%}, "
            f"bubble {self.bubble:.0%}, {lay.moe_path} grouped GEMM {'FP8' if lay.expert_fp8 else 'BF16'}, "
            f"dense GEMMs {'FP8' if lay.dense_fp8 else 'BF16'}) -> {self.step_s:.2f} s/step, "
            f"{lay.tokens / self.step_s:,.0f} tokens/s/GPU, {self.tflops_per_gpu:,.0f} TFLOPS/GPU "
            f"predicted ({peak} peaks of {lay.hardware.name})"
        )
        lines.append(
            "    by term: "
            + ", ".join(f"{k} {v:.2f} s ({v / self.step_s:.0%})" for k, v in self.terms.items() if v > 0)
        )
        lines.append(compile_time.render(m, lay))
        return "\n".join(lines)


@dataclass(frozen=True)
class Recompute:
    """Forward FLOPs per token redone in the backward, by the kernel that reruns them."""

    gemm: float
    grouped: float
    core: float

    @property
    def total(self) -> float:
        return self.gemm + self.grouped + self.core


def _recompute(m: Model, lay: Layout) -> Recompute:
    """Each matmul whose named output is `remat`. MaxText's block tags wi_1's output only `moe_mlpwi_1`,
    which no preset saves. In a scanned loop with XLA's dynamic-slice fusion on, every saved expert GEMM of
    TE runs twice in the forward (`moe/ours-te` turns the fusion off; on one H200, minimal remat, batch 4:
    0.817 s a step scanned against 0.714 s unrolled, `proxy_h200_1gpu_run6_ours_b4_minimal_scanned_hlo.json`)."""
    r = lay.placement
    up, down = m.n_up * m.emb, m.emb
    dense = [
        ("query_proj", m.layers * m.q_weights * 2),
        ("key_proj", m.layers * m.kv_weights * 2),
        ("out_proj", m.layers * m.out_weights * 2),
        ("mlpwi_0", 2 * up * (m.dense_layers * m.mlp + m.moe_layers * m.shared * m.moe_mlp)),
        ("mlpwo", 2 * down * (m.dense_layers * m.mlp + m.moe_layers * m.shared * m.moe_mlp)),
    ]
    experts = m.moe_layers * m.topk * m.moe_mlp
    grouped = [("moe_mlpwi_0", 2 * up * experts), ("moe_mlpwo", 2 * down * experts)]
    rerun = sum(v for name, v in grouped if r[name] == "remat")
    if not lay.dedup_dispatch and lay.remat_name != "custom" and r["moe_mlpwi_0"] != "remat":
        rerun += 2 * m.emb * experts
    if lay.dedup_dispatch and lay.moe_path == "te" and lay.scanned and lay.slice_fusion:
        rerun += sum(v for name, v in grouped if r[name] in ("device", "offload"))
    return Recompute(
        gemm=sum(v for name, v in dense if r[name] == "remat"),
        grouped=rerun,
        core=m.layers * flops.attention_core_per_layer(m, lay.seq) / 3 if r["context"] == "remat" else 0.0,
    )


def expert_rows_computed(m: Model, lay: Layout) -> float:
    """Expert GEMM rows computed per routed (token, expert) copy. Our EP block on TE runs the grouped GEMMs
    over its whole buffer of copies, empty ones included (TE needs groups that cover every row): the
    dropless worst case (EP x the balanced copies) with ragged_buffer_factor -1, else the factor. tokamax
    and MaxText's block skip the empty rows."""
    if lay.ep > 1 and lay.dedup_dispatch and lay.moe_path == "te":
        return memory.rows_per_token(lay, m) / m.topk
    return 1.0


def routed_copies(m: Model, lay: Layout) -> float:
    """(token, expert) copies routed per step on one GPU, over every MoE layer (MTP's included)."""
    return lay.tokens * (m.moe_layers + m.mtp_layers) * m.topk


def _compute_terms(f: flops.Flops, m: Model, lay: Layout, rec: Recompute) -> dict[str, float]:
    """Kernel time of the step's tokens by kind of work, recomputation included, so that `plan` can say which
    term stands between a recipe and a target rate."""
    hw = lay.hardware
    peak = {True: (hw.peak_fp8_tflops or hw.peak_bf16_tflops) * 1e12, False: hw.peak_bf16_tflops * 1e12}
    buffer = expert_rows_computed(m, lay)
    rows = 1 + EMPTY_ROW_COST * (buffer - 1)
    copies = routed_copies(m, lay)
    passes = 2 if memory.keeps_fp8_operands(lay) else 3
    dense_efficiency = DENSE_FP8_GEMM_EFFICIENCY if lay.dense_fp8 else DENSE_GEMM_EFFICIENCY
    xla_sort = not lay.dedup_dispatch and lay.moe_path != "te"
    return {
        "dense GEMMs": lay.tokens * (f.gemm + rec.gemm) / (peak[lay.dense_fp8] * dense_efficiency),
        "expert GEMMs": lay.tokens
        * (f.grouped_gemm + rec.grouped)
        * rows
        / (peak[lay.expert_fp8] * GROUPED_GEMM_EFFICIENCY[lay.moe_path]),
        "attention": lay.tokens * (f.core + rec.core) / (peak[False] * ATTENTION_EFFICIENCY),
        "FP8 expert quantization": (
            copies * buffer * passes * (m.emb + m.moe_mlp) * QUANTIZE_S_PER_ELEMENT if lay.expert_fp8 else 0.0
        ),
        "routing and permutation": copies * PERMUTE_S_PER_COPY["maxtext" if xla_sort else "ours"],
    }


def optimizer_seconds(m: Model, lay: Layout) -> float:
    """The per-step work that does not grow with tokens, over the parameters one GPU holds."""
    return m.total_params / (lay.devices / lay.dp) * STEP_S_PER_PARAM


def _seconds(c: communication.Collective, lay: Layout) -> float:
    """A collective's time at the bandwidth it reaches: NVLink and the host link measured, the network not."""
    return c.seconds if c.gbps == lay.hardware.inter_node_gbps else c.seconds / LINK_EFFICIENCY


def evaluate(name: str, m: Model, lay: Layout, groups: int = 0, topk_groups: int = 0) -> Plan:
    """Plan one layout of one model."""
    f = flops.per_token(m, lay.seq)
    mem = memory.per_gpu(m, lay)
    colls, a2a = communication.per_step(m, lay, groups, topk_groups)
    recompute = _recompute(m, lay)
    bubble = (lay.pp - 1) / (lay.microbatches + lay.pp - 1) if lay.pp > 1 else 0.0
    terms = {k: v / (1 - bubble) for k, v in _compute_terms(f, m, lay, recompute).items()}
    terms["optimizer and per-step work"] = optimizer_seconds(m, lay)
    compute = sum(terms.values())
    hidden = sum(_seconds(c, lay) * (1 - c.exposed_share) for c in colls if c.overlapped)
    shown = sum(_seconds(c, lay) * (1 if not c.overlapped else c.exposed_share) for c in colls)
    terms["collectives on the critical path"] = shown
    terms["overlapped collectives beyond compute"] = max(0.0, hidden - compute)
    return Plan(
        recipe=name,
        model=m,
        layout=lay,
        flops=f,
        memory=mem,
        collectives=colls,
        a2a=a2a,
        compute_s=compute,
        recompute_fraction=recompute.total / f.total,
        bubble=bubble,
        terms=terms,
    )


def estimate(r: ResolvedRecipe, gpus: int | None = None, gpu_type: str | None = None) -> Plan:
    """Plan a resolved recipe, optionally on another GPU count or type."""
    lay = layout.from_recipe(r, gpus, gpu_type)
    if not lay.hardware.peak_bf16_tflops:
        raise UserError(
            f"{lay.hardware.name} has no matrix-unit peak to predict a step time from.",
            key="topology.hardware",
            source=r.sources.get("topology.hardware"),
            fix="plan it for a GPU, e.g. `--gpu-type h200`.",
        )
    return evaluate(
        r.name, Model.from_recipe(r), lay, int(r.effective("n_routing_groups")), int(r.effective("topk_routing_group"))
    )
