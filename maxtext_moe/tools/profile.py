"""Where a profiled training step spends its device time: kernel time by category, by kernel and by HLO op.

Why our own: MaxText writes an XPlane trace (`profiler=xplane`; `maxtext-moe bench --profile` sets it for
two warm-up steps), but reading it needs TensorBoard's profile plugin (xprof), which a GPU node or the
lent machine may not have. JAX ships a reader (`jax.profiler.ProfileData`); this module sums the kernel
events of each GPU plane (on a CPU-only trace: the XLA op events of the host threads) into a short table.

Events are summed per stream, so kernels that overlap on different streams both count: the total can
exceed the wall span, which is also printed.

With the step's optimized HLO beside the trace (`bench --profile` dumps it to RUN/hlo), each kernel's HLO
op is looked up for its `op_name`, the JAX name stack, and the time is also split by what the step does
(`stage`): expert GEMMs, attention forward and backward, dense GEMMs, the MoE block's routing and row
shuffles (its named scopes, `moe/scopes.py`), quantization, the optimizer update (ops outside the
differentiated model) and communication. Idle time is left to the caller, who knows the step time:
the traced span can hold the profiler's own start and stop (`bench` measured one 20 s longer than the
two steps it traced). Where the device ran dry is listed, though: each gap between kernels on a GPU, up to
`GAP_CAP_MS` (longer ones are the profiler's own), is put down to the HLO op whose kernel ended last before
it and the one whose kernel started it, each with its program where the two programs differ (a gap between
the step and another jitted call). A TE custom call that copies its group sizes to the host and waits for the
stream leaves such a gap behind it, which the kernel table cannot show.

    python -m maxtext_moe.tools.profile runs/RUN --top 25 --out summary.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.moe import scopes
from maxtext_moe.plan import hlo_text

# cuBLAS's grouped GEMM kernels (`nvjet_..._ptrGroup_...`), which TE's single-kernel grouped GEMM ("V2") runs:
# XLA may record that call into a command buffer, whose trace events name the buffer instead of TE's op.
GROUPED_KERNEL = "ptrgroup"

# Checked in order; the first that matches the lower-cased kernel name or HLO op wins.
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collective (NCCL)", ("nccl", "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective")),
    ("attention (cuDNN/flash)", ("cudnn", "fmha", "flash", "sdpa", "dot_product_attention")),
    ("TE (grouped GEMM, quantize)", ("nvte", "transformer_engine", "grouped", GROUPED_KERNEL)),
    ("GEMM (cuBLAS/XLA dot)", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "dot")),
    ("copy/memset", ("memcpy", "memset", "copy")),
)


# What the step does, checked in order against the kernel name, its HLO op and that op's name stack.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "all-gather", "all-reduce", "reduce-scatter", "all-to-all", scopes.EXCHANGE)),
    ("quantize/dequantize", ("quantize", "cast_transpose", "amax", "convert_fp8")),
    ("expert GEMMs", ("grouped_gemm", "ragged_dot", "ragged-dot", GROUPED_KERNEL)),
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "dot_product_attention")),
    ("routing, permute, unpermute", (scopes.ROUTING, scopes.PERMUTE, scopes.UNPERMUTE)),
    ("dense GEMMs", ("gemm", "cublas", "cutlass", "nvjet", "xmma", "matmul", "dot_general", "dot.")),
    ("copy/memset", ("memcpy", "memset")),
)
BACKWARD = ("bprop", "bwd", "backward", "dgrad", "wgrad")
_KERNEL_NAME = re.compile(r"[.\-]")
# Gaps longer than this between a GPU's kernels are the profiler starting or stopping, not the step running dry.
GAP_CAP_MS = 100.0
_NUMBERED = re.compile(r"[.\-_]\d+$")
_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]*)"')


def op_names(hlo: Path) -> dict[str, str]:
    """HLO instruction name -> its `op_name` (JAX's name stack) in an optimized-HLO text dump; each name also
    as the kernel name XLA gives a fusion ('.' and '-' as '_'), for `op_name_of`."""
    names: dict[str, str] = {}
    with hlo.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            m = _OP_NAME.match(line)
            if m:
                names.setdefault(m.group(1), m.group(2))
                names.setdefault(_KERNEL_NAME.sub("_", m.group(1)), m.group(2))
    return names


def op_name_of(kernel: str, hlo_op: str, names: dict[str, str]) -> str:
    """The name stack of what a kernel computed. XLA runs sequences of kernels as command buffers (CUDA
    graphs), and the trace then gives the buffer as each kernel's HLO op, which has none: the kernel's own
    name, its fusion's, is the link left."""
    return names.get(hlo_op) or names.get(kernel, "")


def find_hlo(run: Path) -> Path | None:
    """The largest optimized train-step HLO under RUN/hlo (what `bench --profile` dumps), if any."""
    return hlo_text.optimized_hlo(run / "hlo", "train_step")


def stage(kernel: str, hlo_op: str, op_name: str) -> str:
    """What the step was doing in a kernel. Outside any jvp/transpose of the model means after the gradient:
    the optimizer update (and the gradient norm)."""
    text = f"{kernel} {hlo_op} {op_name}".lower()
    name = next((n for n, keys in STAGES if any(k in text for k in keys)), "")
    if name == "attention":
        backward = any(k in text for k in BACKWARD) or "transpose(" in op_name
        return "attention backward" if backward else "attention forward"
    if name == "dense GEMMs" and scopes.EXPERTS in op_name:  # a grouped GEMM lowered to dots (ragged_dot on CPU)
        return "expert GEMMs"
    if name:
        return name
    if op_name and "jvp(" not in op_name and "transpose(" not in op_name:
        return "optimizer"
    return "other (norms, activations, elementwise)"


def find_trace(path: Path) -> Path:
    """`path` itself, or the newest *.xplane.pb under it."""
    if path.is_file():
        return path
    traces = sorted(path.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise UserError(
            f"no profile (*.xplane.pb) under {path}.",
            fix="profile a run first: maxtext-moe bench RECIPE --profile (or profiler=xplane).",
        )
    return traces[-1]


def category(kernel: str, hlo_op: str) -> str:
    text = f"{kernel} {hlo_op}".lower()
    return next((name for name, keys in CATEGORIES if any(k in text for k in keys)), "other (fusions, sort, ...)")


Event = tuple[int, int, str, str]  # a kernel's start and end (ns), its HLO op and its HLO module


def idle_gaps(events: list[Event]) -> list[tuple[int, Event, Event]]:
    """Each stretch with no kernel running, in time order: (its length in ns, the kernel that ended last before
    it, the kernel that ended it). `events` are every kernel of one device, on any stream."""
    gaps, reach, last = [], None, None
    for event in sorted(events):
        start, end = event[0], event[1]
        if last is not None and start > reach:
            gaps.append((start - reach, last, event))
        if last is None or end > reach:
            reach, last = end, event
    return gaps


def busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Time covered by at least one of the (start, end) intervals: kernels on several streams overlap, so
    their summed durations can exceed the time the device had work."""
    if not intervals:
        return 0
    span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    return span - sum(gap for gap, _, _ in idle_gaps([(s, e, "", "") for s, e in intervals]))


def gap_name(before: Event, after: Event) -> str:
    """`OP -> OP` for a gap between two kernels, each op without its instance number
    (`te_grouped_gemm_ffi.12` -> `te_grouped_gemm_ffi`, so that the calls of one kind add up), and each with its
    HLO module where the two modules differ."""
    ops = [_NUMBERED.sub("", e[2]) or "(no hlo_op)" for e in (before, after)]
    if before[3] != after[3]:
        ops = [f"{op} ({e[3] or 'no module'})" for op, e in zip(ops, (before, after), strict=True)]
    return " -> ".join(ops)


def gaps_after(events: list[Event], cap_ns: int) -> dict[str, tuple[float, int]]:
    """Idle time on one device, by the ops on either side of each gap (`gap_name`): {name: (ms, gaps)}. Gaps of
    `cap_ns` or more are left out."""
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for gap, before, after in idle_gaps(events):
        if gap < cap_ns:
            row = out[gap_name(before, after)]
            row[0] += gap / 1e6
            row[1] += 1
    return {op: (ms, int(n)) for op, (ms, n) in sorted(out.items(), key=lambda kv: -kv[1][0])}


def summarize(trace: Path, top: int, hlo: Path | None = None) -> dict[str, Any]:
    """Kernel time by category, kernel and HLO op; with `hlo` (the step's optimized HLO text) also by
    `stage` of the step."""
    from jax.profiler import ProfileData

    names = op_names(hlo) if hlo else {}
    data = ProfileData.from_file(str(trace))
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    source = "GPU kernels"
    if not planes:
        planes, source = [p for p in data.planes if p.name.startswith("/host:CPU")], "host XLA ops (no GPU plane)"
    by_kernel: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    by_cat: collections.Counter[str] = collections.Counter()
    by_stage: collections.Counter[str] = collections.Counter()
    first, last = float("inf"), 0.0
    per_plane = []
    idle_after: collections.Counter[str] = collections.Counter()
    gaps_per_name: collections.Counter[str] = collections.Counter()
    for plane in planes:
        events = []
        for line in plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                op = str(stats.get("hlo_op", ""))
                if source != "GPU kernels" and not op:
                    continue
                ms = ev.duration_ns / 1e6
                by_kernel[ev.name] += ms
                by_op[op or "(no hlo_op)"] += ms
                by_cat[category(ev.name, op)] += ms
                if names:
                    by_stage[stage(ev.name, op, op_name_of(ev.name, op, names))] += ms
                events.append((ev.start_ns, ev.start_ns + ev.duration_ns, op, str(stats.get("hlo_module", ""))))
        if source == "GPU kernels":
            for gap, (ms, n) in gaps_after(events, int(GAP_CAP_MS * 1e6)).items():
                idle_after[gap] += ms
                gaps_per_name[gap] += n
        spans = [(e[0], e[1]) for e in events]
        if spans:
            first, last = min(first, min(s for s, _ in spans)), max(last, max(e for _, e in spans))
            span = max(e for _, e in spans) - min(s for s, _ in spans)
            per_plane.append(
                {
                    "plane": plane.name,
                    "kernel_ms": sum(e - s for s, e in spans) / 1e6,
                    "busy_ms": busy_ns(spans) / 1e6,
                    "span_ms": span / 1e6,
                }
            )
    total = sum(by_cat.values())
    if not total:
        raise UserError(f"the profile {trace} holds no device events.", fix="profile again with more steps.")
    return {
        "trace": str(trace),
        "source": source,
        "planes": [p.name for p in planes],
        "total_ms": total,
        "wall_span_ms": (last - first) / 1e6,
        "per_plane": per_plane,
        "categories": by_cat.most_common(),
        "hlo": str(hlo) if hlo else None,
        "stages": by_stage.most_common(),
        "kernels": by_kernel.most_common(top),
        "hlo_ops": by_op.most_common(top),
        "idle_after": [(gap, ms, gaps_per_name[gap]) for gap, ms in idle_after.most_common(top)],
    }


def render(s: dict[str, Any]) -> str:
    lines = [
        f"{s['source']} in {s['trace']}",
        f"summed {s['total_ms']:.1f} ms over a wall span of {s['wall_span_ms']:.1f} ms ({', '.join(s['planes'])})",
    ]
    lines += [
        f"  {p['plane']}: busy {p['busy_ms']:.1f} of {p['span_ms']:.1f} ms ({p['busy_ms'] / p['span_ms']:.0%}), "
        f"kernels summed {p['kernel_ms']:.1f} ms"
        for p in s["per_plane"]
        if p["span_ms"]
    ]
    lines.append("")
    stages = (("stage", s["stages"]),) if s.get("stages") else ()
    for title, rows in (*stages, ("category", s["categories"]), ("kernel", s["kernels"]), ("HLO op", s["hlo_ops"])):
        lines.append(f"{'ms':>10} {'share':>6}  {title}")
        lines += [f"{ms:>10.2f} {ms / s['total_ms']:>6.1%}  {name[:110]}" for name, ms in rows]
        lines.append("")
    if s.get("idle_after"):
        lines.append(f"{'ms':>10} {'gaps':>6}  device idle between (gaps under {GAP_CAP_MS:.0f} ms)")
        lines += [f"{ms:>10.2f} {n:>6}  {gap[:110]}" for gap, ms, n in s["idle_after"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", type=Path, help="an .xplane.pb file or a folder holding one (newest wins)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, help="also write the summary as JSON")
    ap.add_argument("--hlo", type=Path, help="the step's optimized HLO text (default: RUN/hlo, as bench dumps it)")
    a = ap.parse_args(argv)
    trace = find_trace(a.path)
    hlo = a.hlo or next((h for d in (a.path, *a.path.parents) if d.is_dir() and (h := find_hlo(d))), None)
    summary = summarize(trace, a.top, hlo)
    print(render(summary))
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
