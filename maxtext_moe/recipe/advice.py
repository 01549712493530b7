"""Settings that run but not as a user may assume, said before compute is spent: slower than they need to
be (as measured), or a DeepSeek-V3 that routes differently from the paper.

Why: validation refuses what cannot run, and MaxText says nothing about combinations that run but waste
the GPU in ways only a profile or the compiled HLO shows. Each note names the measurement it rests on.
"""

from __future__ import annotations

from maxtext_moe.recipe.resolved import ResolvedRecipe


def notes(resolved: ResolvedRecipe) -> list[str]:
    """One line per measured slow combination or routing difference in `resolved`; empty when there is none."""
    found = _routing_differences(resolved)
    moe, policy = resolved.moe_settings, str(resolved.effective("remat_policy"))
    scanned = resolved.effective("scan_layers")
    if moe.ours and moe.gemm == "te" and scanned and policy != "full" and resolved.slice_fusion:
        found.append(
            f"note: scan_layers is true with moe.gemm: te, remat_policy: {policy} and XLA's dynamic-slice fusion on; "
            "it runs every saved expert GEMM twice in the forward loop (on an H200, 48 grouped GEMMs a step instead "
            "of 36; 0.817 s against 0.714 s unrolled). Set xla_flags.xla_gpu_enable_dynamic_slice_fusion=false, as "
            "moe/ours-te does (docs/UPSTREAM.md)."
        )
    expert_parallel = any(resolved.effective(f"{net}_expert_parallelism") != 1 for net in ("ici", "dcn"))
    if moe.ours and moe.gemm == "te" and expert_parallel and float(resolved.effective("ragged_buffer_factor")) <= 0:
        found.append(
            "note: ragged_buffer_factor is -1 with moe.gemm: te and expert parallelism; TE then computes every slot "
            "of the worst-case buffer, EP x the routed rows. On two H200s (EP2, batch 4) the step took 0.983 s at -1 "
            "and 0.867 s at 1.25. Set ragged_buffer_factor to 1.1-1.25; a step that needs more stops with an error, "
            "nothing is dropped (docs/RECIPES.md)."
        )
    if (
        resolved.attention["residuals"] == "recompute"
        and resolved.effective("attention") == "cudnn_flash_jax"
        and policy != "full"
    ):
        found.append(
            f"note: remat_policy: {policy} with cuDNN attention reruns the attention forward kernel in the backward "
            "pass; attention.residuals: save kept its outputs instead, 1.05x faster for 2.3 GiB on one H200 "
            "at batch 8 (docs/PERFORMANCE.md)."
        )
    if resolved.effective("quantization") == "te_fp8_delayedscaling":
        found.append(
            "note: quantization: te_fp8_delayedscaling scales each FP8 tensor by the amax TE recorded in earlier "
            "steps; on one H200 the proxy with it reached loss 4.72 after 9 steps where te_fp8_currentscaling "
            "reached 1.28, for 0.7% less time a step. Use te_fp8_currentscaling (docs/PERFORMANCE.md)."
        )
    return found


def _routing_differences(resolved: ResolvedRecipe) -> list[str]:
    """DeepSeek-V3's routing (group-limited top-k, the aux-loss-free bias update, one MTP layer) left out of a
    DeepSeek-V3 recipe, as NVIDIA's published configuration leaves it: the model trains, but not as trained."""
    if not str(resolved.effective("model_name")).startswith("deepseek3"):
        return []
    missing = [
        what
        for what, off in (
            ("no group-limited routing (n_routing_groups <= 1)", int(resolved.effective("n_routing_groups")) <= 1),
            ("no bias update (routed_bias_update_rate 0)", float(resolved.effective("routed_bias_update_rate")) <= 0),
            ("no MTP layer (mtp_num_layers 0)", int(resolved.effective("mtp_num_layers")) == 0),
        )
        if off
    ]
    if not missing:
        return []
    return [
        f"note: routing differs from DeepSeek-V3 as trained: {'; '.join(missing)}. The deepseek3-671b-<gpu> "
        "recipes (`maxtext-moe list`) keep all three on maxtext-moe's block."
    ]
