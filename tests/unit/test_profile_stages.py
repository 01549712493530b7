"""The profile's split by stage reads the MoE block's named scopes back from a real compiled step's HLO:
routing and row shuffles, expert GEMMs, and the update after the gradient as the optimizer."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from maxtext_moe.moe.layer import MoEConfig, init_params, moe_forward
from maxtext_moe.moe.routing import RoutingConfig
from maxtext_moe.moe.settings import ExpertPath
from maxtext_moe.tools import profile

CFG = MoEConfig(64, 32, RoutingConfig(num_experts=8, top_k=2, n_groups=2, topk_groups=1), shared_mlp_dim=32)


@pytest.fixture(scope="module")
def step_hlo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compiled training step of the MoE block (gradient, then an update), as `bench --profile` dumps it."""
    params = init_params(jax.random.key(0), CFG, jnp.float32)
    x = jax.random.normal(jax.random.key(1), (64, CFG.emb_dim))

    def step(p: dict, x: jax.Array) -> dict:
        grads = jax.grad(lambda p: jnp.sum(moe_forward(p, x, CFG, ExpertPath())[0] ** 2))(p)
        return jax.tree.map(lambda w, g: w - 1e-3 * jnp.sign(g), p, grads)

    hlo = tmp_path_factory.mktemp("hlo") / "jit_train_step.after_optimizations.txt"
    hlo.write_text(jax.jit(step).lower(params, x).compile().as_text())
    return hlo


def test_compiled_step_ops_fall_into_the_block_stages(step_hlo: Path) -> None:
    names = profile.op_names(step_hlo)
    stages = Counter(profile.stage(op, op, name) for op, name in names.items())
    assert stages["routing, permute, unpermute"] and stages["expert GEMMs"] and stages["optimizer"], stages
    routing = [n for op, n in names.items() if profile.stage(op, op, n) == "routing, permute, unpermute"]
    assert any("jvp(" in n for n in routing) and any("transpose(" in n for n in routing)  # forward and backward
    assert profile.stage("nvjet_sm90_tst_128x256", "custom-call.3", "jit(s)/jvp()/dot_general") == "dense GEMMs"
    assert profile.stage("cudnn_fmha_bprop", "custom-call.9", "") == "attention backward"
    assert profile.stage("ncclDevKernel_AllGather", "all-gather-start", "") == "communication"


def test_a_kernel_run_inside_a_command_buffer_takes_the_stage_of_its_own_fusion(step_hlo: Path) -> None:
    """On the GPU XLA runs sequences of kernels as command buffers (CUDA graphs), and the profile then gives the
    buffer as each kernel's HLO op, which has no name stack (the H200 proxy's BF16 profile counted its AdamW
    update as "other"); the kernel's own name (its fusion's, with '.' and '-' as '_') still says."""
    names = profile.op_names(step_hlo)
    fusions = {op: n for op, n in names.items() if "fusion" in op and "." in op and n}
    assert fusions
    for op, name in fusions.items():
        kernel = op.replace(".", "_").replace("-", "_")
        assert profile.op_name_of(kernel, "command_buffer_875", names) == name
        assert profile.stage(kernel, "command_buffer_875", name) == profile.stage(op, op, name)
    assert "optimizer" in {profile.stage(op, "command_buffer_875", n) for op, n in fusions.items()}
    op, name = next(iter(fusions.items()))
    assert profile.op_name_of("nvjet_sm90_tst_128x256", op, names) == name  # an op's own name stack comes first
    assert profile.op_name_of("nvjet_sm90_tst_128x256", "command_buffer_875", names) == ""


def test_tes_single_kernel_grouped_gemm_inside_a_command_buffer_counts_as_expert_gemms() -> None:
    """TE's V2 grouped GEMM is one cuBLAS grouped kernel (`nvjet_..._ptrGroup_...`) that XLA may record into a
    command buffer; the trace then names the buffer, not TE's custom call. The BF16 V2 profile on the H200
    (2026-12-02) counted half of its expert GEMMs as dense GEMMs so, and the expert rate at 165% of the
    matmul rate."""
    kernel = "nvjet_sm90_tst_320x128_64x3_1x2_h_bx_coopB_ptrGroup_TNT"
    assert profile.stage(kernel, "command_buffer_849", "") == "expert GEMMs"
    assert profile.stage(kernel, "te_grouped_gemm_ffi.340", "") == "expert GEMMs"
    assert profile.category(kernel, "command_buffer_849") == "TE (grouped GEMM, quantize)"
    assert profile.stage("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_TNN", "command_buffer_849", "") == "dense GEMMs"


def test_idle_gaps_are_put_down_to_the_ops_on_either_side() -> None:
    """A gap is named by the op that ended last before it and the op that ended it, and by their programs where
    those differ: TE's host round trips inside the step read apart from the gaps between the step and another
    jitted call."""
    ms = 1_000_000
    step = "jit_train_step"
    events = [
        (0, 10 * ms, "fusion.1", step),
        (2 * ms, 12 * ms, "te_grouped_gemm_ffi.3", step),  # another stream, ends last: the 2 ms gap is its
        (14 * ms, 15 * ms, "te_grouped_gemm_ffi.7", step),
        (16 * ms, 17 * ms, "command_buffer_12", step),  # 1 ms after te_grouped_gemm_ffi.7
        (16 * ms + ms // 10, 16 * ms + ms // 2, "fusion.2", step),  # inside the command buffer's span: no gap
        (20 * ms, 21 * ms, "copy.4", "jit_batch"),  # 3 ms: between the step and another program
        (500 * ms, 501 * ms, "fusion.3", step),  # 479 ms: the profiler, not the step
        (501 * ms + ms // 4, 502 * ms, "fusion.4", step),
    ]
    gaps = profile.gaps_after(events, cap_ns=100 * ms)
    assert gaps == {
        "command_buffer (jit_train_step) -> copy (jit_batch)": (3.0, 1),
        "te_grouped_gemm_ffi -> te_grouped_gemm_ffi": (2.0, 1),
        "te_grouped_gemm_ffi -> command_buffer": (1.0, 1),
        "fusion -> fusion": (0.25, 1),
    }
    assert list(gaps)[0].startswith("command_buffer")  # the largest first
    assert profile.gaps_after([], cap_ns=ms) == {}
