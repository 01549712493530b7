"""Step time, TFLOPS/GPU and the fit verdict of one layout; text and JSON rendering.

The compute rates are measured ones where we have them (on an H200; docs/PERFORMANCE.md): a large
BF16 GEMM reaches 790/989 of peak; the routed experts' grouped GEMM reaches 637/989 through TE,
276/989 through tokamax and 23/989 through `jax.lax.ragged_dot`. Other profiles and FP8 are assumed
to reach the same fraction of their own peak; flash attention is assumed at half of BF16 peak (not
measured). Collectives the latency-hiding scheduler can overlap cost only what exceeds compute; the
EP all-to-all sits on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.plan import communication, flops, layout, memory
from maxtext_moe.plan.layout import Layout
from maxtext_moe.plan.model import Model
from maxtext_moe.recipe.resolved import ResolvedRecipe

GIB = 2**30
DENSE_GEMM_EFFICIENCY = 790 / 989
GROUPED_GEMM_EFFICIENCY = {"te": 637 / 989, "tokamax": 276 / 989, "ragged_dot": 23 / 989, "dense": 790 / 989}
ATTENTION_EFFICIENCY = 0.5  # assumption: flash attention at half of BF16 peak


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
    step_s: float

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
            "tokens_per_s_per_gpu": lay.tokens / self.step_s,
            "predicted_tflops_per_gpu": self.tflops_per_gpu,
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
            f"({lay.hardware.hbm_gib:.1f} GiB x {lay.mem_fraction:g}) -> {verdict}",
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
                f"{' (overlapped)' if c.overlapped else ''}"
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
        return "\n".join(lines)


def _recompute(m: Model, lay: Layout) -> float:
    """Forward FLOPs per token redone in the backward: each matmul whose named output is `remat`."""
    r = lay.remat
    up, down = m.n_up * m.emb, m.emb
    parts = [
        ("query_proj", m.layers * m.q_weights * 2),
        ("key_proj", m.layers * m.kv_weights * 2),
        ("out_proj", m.layers * m.out_weights * 2),
        ("context", m.layers * flops.attention_core_per_layer(m, lay.seq) / 3),
        ("mlpwi_0", 2 * up * (m.dense_layers * m.mlp + m.moe_layers * m.shared * m.moe_mlp)),
        ("mlpwo", 2 * down * (m.dense_layers * m.mlp + m.moe_layers * m.shared * m.moe_mlp)),
        ("moe_mlpwi_0", 2 * up * m.moe_layers * m.topk * m.moe_mlp),
        ("moe_mlpwo", 2 * down * m.moe_layers * m.topk * m.moe_mlp),
    ]
    return sum(v for name, v in parts if r[name] == "remat")


def expert_rows_computed(m: Model, lay: Layout) -> float:
    """Expert GEMM rows computed per routed (token, expert) copy. Our EP block on TE runs the grouped GEMMs
    over its whole buffer of copies, empty ones included (TE needs groups that cover every row): the
    dropless worst case (EP x the balanced copies) with ragged_buffer_factor -1, else the factor. tokamax
    and MaxText's block skip the empty rows."""
    if lay.ep > 1 and lay.dedup_dispatch and lay.moe_path == "te":
        return memory.rows_per_token(lay, m) / m.topk
    return 1.0


def _compute_seconds(f: flops.Flops, m: Model, lay: Layout, recompute: float) -> float:
    hw = lay.hardware
    peak = {True: (hw.peak_fp8_tflops or hw.peak_bf16_tflops) * 1e12, False: hw.peak_bf16_tflops * 1e12}
    scale = 1 + recompute / f.total  # recompute spread over the step's mix of kernels
    t = lay.tokens * scale
    grouped = f.grouped_gemm * expert_rows_computed(m, lay)
    return t * (
        f.gemm / (peak[lay.dense_fp8] * DENSE_GEMM_EFFICIENCY)
        + grouped / (peak[lay.expert_fp8] * GROUPED_GEMM_EFFICIENCY[lay.moe_path])
        + f.core / (peak[False] * ATTENTION_EFFICIENCY)
    )


def evaluate(name: str, m: Model, lay: Layout, groups: int = 0, topk_groups: int = 0) -> Plan:
    """Plan one layout of one model."""
    f = flops.per_token(m, lay.seq)
    mem = memory.per_gpu(m, lay)
    colls, a2a = communication.per_step(m, lay, groups, topk_groups)
    recompute = _recompute(m, lay)
    bubble = (lay.pp - 1) / (lay.microbatches + lay.pp - 1) if lay.pp > 1 else 0.0
    compute = _compute_seconds(f, m, lay, recompute) / (1 - bubble)
    hidden = sum(c.seconds for c in colls if c.overlapped)
    exposed = sum(c.seconds for c in colls if not c.overlapped) + max(0.0, hidden - compute)
    return Plan(
        recipe=name,
        model=m,
        layout=lay,
        flops=f,
        memory=mem,
        collectives=colls,
        a2a=a2a,
        compute_s=compute,
        recompute_fraction=recompute / f.total,
        bubble=bubble,
        step_s=compute + exposed,
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
