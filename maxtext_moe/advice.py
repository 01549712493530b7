"""Settings that run correctly but slower than they need to, as measured: said before compute is spent.

Why: validation refuses what cannot run, and MaxText says nothing about combinations that run but waste
the GPU in ways only a profile or the compiled HLO shows. Each note names the measurement it rests on.
"""

from __future__ import annotations

from maxtext_moe.resolved import ResolvedRecipe


def notes(resolved: ResolvedRecipe) -> list[str]:
    """One line per measured slow combination in `resolved`; empty when there is none."""
    found = []
    moe, policy = resolved.moe, str(resolved.effective("remat_policy"))
    if moe.get("impl") == "ours" and moe.get("gemm") == "te" and resolved.effective("scan_layers") and policy != "full":
        found.append(
            f"note: scan_layers is true with moe.gemm: te and remat_policy: {policy}; on an H200 the scanned step "
            "computed every saved expert GEMM output twice (48 grouped GEMMs a step instead of 36; 0.817 s against "
            "0.714 s unrolled). Set scan_layers: false unless compile time matters more (docs/PERFORMANCE.md).")
    return found
