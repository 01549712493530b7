"""Write docs/results/INDEX.md: one row per raw result file, read from the JSON itself.

    python benchmarks/results_index.py            # rewrite docs/results/INDEX.md
    python benchmarks/results_index.py --check    # exit 1 if the committed index is not what this writes

Each JSON in docs/results/ is one of a few kinds, told apart by its keys:
- `maxtext-moe bench --json` (`model_tflops_per_gpu`): TFLOPS/GPU, median s/step, MFU, peak GiB;
- `maxtext-moe plan --compile --json` (`compiled`): XLA's per-device total beside the plan;
- `benchmarks/bench_attention.py` (`forward_tflops`), `bench_moe_layer.py`, `bench_ep_dispatch.py` and
  `bench_receive.py` (`runs`),
  `benchmarks/loss_curves.py` (`relative_gap`), and a profile summary (`categories`).
The other files (logs, text records, HLO dumps) are listed by name. A bench JSON does not record the command
line, so the settings column gives the values that tell rungs apart, read from what the run resolved.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"
INDEX = RESULTS / "INDEX.md"
GIB = 2**30
DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


def _date(name: str, data: dict) -> str:
    for text in (name, str(data.get("date", "")), str(data.get("note", ""))[:12]):
        if m := DATE.search(text):
            return m.group(1)
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _bench_settings(d: dict) -> str:
    s, moe = d.get("settings") or {}, d.get("moe") or {}
    out = [f"batch {s.get('per_device_batch_size', '?')}"]
    impl = moe.get("impl")
    out.append(f"moe.impl={impl}" if impl else "moe section not recorded")
    if impl == "ours" and moe.get("gemm") and moe.get("gemm") != "te":
        out.append(f"moe.gemm={moe['gemm']}")
    if moe.get("fp8") not in (None, "none"):
        out.append(f"moe.fp8={moe['fp8']}")
    if moe.get("te_gemm_path") not in (None, "auto"):
        out.append(f"moe.te_gemm_path={moe['te_gemm_path']}")
    if (chunks := moe.get("dispatch_chunks")) not in (None, 1):
        out.append(f"moe.dispatch_chunks={chunks}")
    for key in ("quantization", "remat_policy", "attention"):
        if s.get(key):
            out.append(f"{key}={s[key]}")
    out.append(f"scan_layers={str(s.get('scan_layers', '?')).lower()}")
    if (residuals := (d.get("attention") or {}).get("residuals")) is not None:
        out.append(f"attention.residuals={residuals}")
    if (kernel := (d.get("attention") or {}).get("kernel")) not in (None, "cudnn"):
        out.append(f"attention.kernel={kernel}")
    if projections := (d.get("attention") or {}).get("bf16_projections"):
        out.append(f"attention.bf16_projections=[{','.join(projections)}]")
    out += [f"{key}=true" for key in ("prefuse_moe_weights", "use_sliced_mla_proj") if s.get(key)]
    if d.get("variant"):  # a change of source the settings do not show, written into the file by hand
        out.append(d["variant"])
    if s.get("n_routing_groups", -1) in (-1, None) or not s.get("mtp_num_layers"):
        out.append(f"groups {s.get('n_routing_groups', '-')}, mtp {s.get('mtp_num_layers', 0)}")
    if (factor := s.get("ragged_buffer_factor")) not in (None, -1, -1.0):
        out.append(f"ragged_buffer_factor={factor}")
    if (frac := (d.get("env") or {}).get("XLA_PYTHON_CLIENT_MEM_FRACTION")) not in (None, "0.88"):
        out.append(f"mem fraction {frac}")
    if s.get("max_target_length", 4096) != 4096:
        out.append(f"seq {s['max_target_length']}")
    return ", ".join(out)


def _bench(d: dict) -> tuple[str, str, str, str]:
    machine = f"{d.get('devices', '?')} x {str(d.get('hardware', '?')).upper()}"
    if d.get("model_tflops_per_gpu") is None:
        figure = "no timed step"
    else:
        figure = (
            f"{d['model_tflops_per_gpu']:.1f} TFLOPS/GPU, {d['step_s_median']:.3f} s/step, "
            f"{d['mfu_bf16']:.1%} MFU, {d['peak_device_memory_gib']:.1f} GiB peak"
        )
    return d.get("recipe", ""), _bench_settings(d), machine, figure


def _compile(d: dict) -> tuple[str, str, str, str]:
    c = d["compiled"]
    total = d.get("device_total_bytes") or c.get("device_total_bytes")
    if total is None:
        m = c["memory"]
        total = m["argument_size"] + m["output_size"] + m["temp_size"] - m["alias_size"] + m["generated_code_size"]
    figure = f"XLA {total / GIB:.1f} GiB/GPU"
    if planned := (d.get("planned") or {}).get("memory_per_gpu_bytes"):
        figure += f", planned {planned / GIB:.1f} GiB"
    if (seconds := c.get("compile_s") or d.get("wall_s")) is not None:
        figure += f", compiled in {seconds:.0f} s"
    if remat := d.get("remat_gemms"):
        gemms, again = remat["xla_gemm_flops"] / 1e12, remat["remat_gemm_flops"] / 1e12
        figure += f", XLA GEMMs {gemms:.1f} TFLOP ({again:.1f} recomputed)"
    overrides = " ".join([*(d.get("compiled_with_overrides") or []), *([d["variant"]] if d.get("variant") else [])])
    devices = c.get("devices", "?")
    where = {"gpu": "an H200, mock topology", "gpu-aot": "deviceless (CPU host)", "cpu": "XLA:CPU"}
    machine = f"{devices} device{'s' if devices != 1 else ''}, {where.get(d.get('route'), d.get('route', '?'))}"
    return d.get("recipe", ""), f"plan --compile {overrides}".strip(), machine, figure


def _attention(d: dict) -> tuple[str, str, str, str]:
    c = d["config"]
    shape = f"batch {c['batch']}, seq {c['seq']}, d_qk {c['d_qk']}, d_v {c['d_v']}"
    settings = f"{c.get('implementation', 'cudnn')}, {shape}, cuDNN {d.get('cudnn_version')}"
    figure = (
        f"forward {d['forward']['median_ms']:.2f} ms ({d['forward_tflops']:.0f} TFLOP/s), "
        f"backward {d['backward_ms']:.2f} ms ({d['backward_tflops']:.0f} TFLOP/s)"
    )
    return "benchmarks/bench_attention.py", settings, d.get("device", ""), figure


def _runs(d: dict) -> tuple[str, str, str, str]:
    if "run2" in d:  # two runs of the MoE layer benchmark in one file: the later one
        d = d["run2"]
    c = d.get("config", {})

    def figures(key: str, text: str) -> list[str]:
        return [text.format(**r) for r in d["runs"] if r.get(key) is not None]

    if "impl" in c:
        tool = "benchmarks/bench_ep_dispatch.py"
        settings = f"{c.get('impl')}, {c.get('tokens_per_device')} tokens/GPU, {c.get('experts')} experts"
        parts = [
            f"{'dedup' if r.get('dedup') else 'no dedup'} {r['median_ms']:.1f} ms"
            for r in d["runs"]
            if r.get("median_ms") is not None
        ]
    elif "ranks" in c:
        tool = "benchmarks/bench_receive.py"
        settings = f"one EP{c['ranks']} rank, {c['experts']} experts, top-{c['top_k']}, {c['backend']}, FP8 {c['fp8']}"
        parts = figures("median_ms", "{variant} at {tokens} tokens {median_ms:.2f} ms")
    else:
        tool = "benchmarks/bench_moe_layer.py"
        settings = f"{c.get('experts')} experts, top-{c.get('top_k')}"
        parts = figures("tflops", "{variant} at {tokens} tokens {tflops:.0f} TFLOP/s")
    devices = d.get("devices") or [d.get("device", "")]
    machine = f"{len(devices)} x {devices[0]}" if isinstance(devices, list) else str(devices)
    return tool, settings, machine, "; ".join(parts)


def _loss_curves(d: dict) -> tuple[str, str, str, str]:
    figure = (
        f"last-{d['window']}-step mean loss {d['base_tail_mean']:.4f} against {d['other_tail_mean']:.4f} "
        f"({d['relative_gap']:+.2%}; within {d['tolerance']:.0%}: {d['within']})"
    )
    return "benchmarks/loss_curves.py", f"{d['steps']} steps", "", figure


def _profile(d: dict) -> tuple[str, str, str, str]:
    return "profile summary", d.get("source", ""), ", ".join(d.get("planes", [])), f"{d['total_ms']:.1f} ms of kernels"


def describe(name: str, d: dict) -> tuple[str, str, str, str]:
    """(what ran, settings, machine, figure) of one result JSON."""
    if "model_tflops_per_gpu" in d:
        return _bench(d)
    if "compiled" in d:
        return _compile(d)
    if "forward_tflops" in d:
        return _attention(d)
    if "runs" in d or "run2" in d:
        return _runs(d)
    if "relative_gap" in d:
        return _loss_curves(d)
    if "categories" in d:
        return _profile(d)
    raise ValueError(f"{name}: a result JSON of no known kind (keys: {sorted(d)[:8]})")


def render(results: Path = RESULTS) -> str:
    lines = [
        "# Raw results",
        "",
        "Generated by `python benchmarks/results_index.py` from the files in this folder; do not edit by hand",
        "(a unit test compares it with the script's output). Dates come from the file name or the JSON. A bench",
        "JSON records what the run resolved, not its command line: the settings column gives the values that tell",
        "runs apart (batch per GPU, MoE block and its FP8, MaxText's quantization, remat, layers scanned or not,",
        "and the routing or memory fraction where they differ from the recipes).",
        "",
        "| file | date | what ran | settings | machine | figure |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    others = []
    for path in sorted(results.iterdir()):
        if path.name == INDEX.name:
            continue
        if path.suffix != ".json":
            others.append(path.name + ("/" if path.is_dir() else ""))
            continue
        data = json.loads(path.read_text(encoding="utf-8"))
        what, settings, machine, figure = describe(path.name, data)
        row = [f"`{path.name}`", _date(path.name, data), what, settings, machine, figure]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += ["", "Other files (logs, text records, HLO dumps), listed by name:", ""]
    lines += [f"- `{name}`" for name in others]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed index instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if INDEX.read_text(encoding="utf-8") != text:
            print(f"{INDEX} is stale: run python benchmarks/results_index.py", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text, encoding="utf-8")
    print(f"wrote {INDEX}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
