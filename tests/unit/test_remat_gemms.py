"""XLA's own GEMM work in a compiled step, and the part its rematerialization recomputes: from a real XLA:CPU
dump (GEMMs in the entry computation and in a loop body run N times), and from HLO text shaped as XLA:GPU
writes a rematerialized GEMM fusion."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from maxtext_moe.errors import UserError
from maxtext_moe.plan import remat_gemms

M, K, N, STEPS = 256, 512, 128, 5


def step(x: jax.Array, w: jax.Array, v: jax.Array) -> jax.Array:
    """One [M,K]x[K,N] GEMM, then STEPS [M,N]x[N,N] GEMMs in a loop XLA keeps as a while loop."""
    h = x @ w
    return jax.lax.fori_loop(0, STEPS, lambda _, h: jnp.tanh(h @ v), h)


def test_gemm_flops_of_a_real_dump_count_loop_bodies_by_their_trip_count(tmp_path: Path) -> None:
    args = (jnp.ones((M, K)), jnp.ones((K, N)), jnp.ones((N, N)))
    options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_step"}
    jax.jit(step).lower(*args).compile(options)
    found = remat_gemms.find(tmp_path, module="jit_step")
    assert found.total_flops == 2 * M * K * N + STEPS * 2 * M * N * N
    assert found.remat_flops == 0 and found.by_shape == {}
    assert "0.0 recomputed" in found.render()


GPU_TEXT = """HloModule jit_train_step

%gemm_fusion_dot.1_computation (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%gemm_fusion_dot.1_computation.1 (p0.1: bf16[64,32], p1.1: bf16[32,16]) -> bf16[64,16] {
  %p0.1 = bf16[64,32]{1,0} parameter(0)
  %p1.1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.2 = bf16[64,16]{1,0} dot(%p0.1, %p1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (a: bf16[64,32], b: bf16[32,16]) -> bf16[64,16] {
  %a = bf16[64,32]{1,0} parameter(0)
  %b = bf16[32,16]{1,0} parameter(1)
  %gemm_fusion_dot.1 = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %gemm_fusion_dot.1.remat2 = bf16[64,16]{1,0} fusion(%a, %b), kind=kCustom, calls=%gemm_fusion_dot.1_computation.1
  ROOT %add.3 = bf16[64,16]{1,0} add(%gemm_fusion_dot.1, %gemm_fusion_dot.1.remat2)
}
"""


def test_a_rematerialized_gemm_fusion_counts_as_recomputed_work() -> None:
    found = remat_gemms.analyse(GPU_TEXT)
    one = 2 * 64 * 32 * 16
    assert (found.total_flops, found.remat_flops) == (2 * one, one)
    assert found.by_shape == {"[64,16] K=32": one}
    assert "[64,16] K=32" in found.render()


# The same GEMM as an autotuned compile on an H200 writes it (a line of the FP8 proxy's step, its backend config cut
# short): a cuBLAS custom call whose result is the product and a workspace, then a recomputed copy.
CUBLAS_CONFIG = (
    'custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,'
    '"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],'
    '"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]},"epilogue":"DEFAULT"}}'
)
CUBLAS_TEXT = f"""HloModule jit_train_step

ENTRY %main.9 (a: bf16[32768,14336], w: bf16[14336,7168]) -> bf16[32768,7168] {{
  %bitcast.1374.0 = bf16[32768,14336]{{1,0}} parameter(0)
  %w = bf16[14336,7168]{{1,0}} parameter(1)
  %custom-call.73 = (bf16[32768,7168]{{1,0}}, s8[33554432]{{0}}) custom-call(%bitcast.1374.0, %w), {CUBLAS_CONFIG}
  %custom-call.73.remat = (bf16[32768,7168]{{1,0}}, s8[33554432]{{0}}) custom-call(%bitcast.1374.0, %w), {CUBLAS_CONFIG}
  %gte.1 = bf16[32768,7168]{{1,0}} get-tuple-element(%custom-call.73), index=0
  %gte.2 = bf16[32768,7168]{{1,0}} get-tuple-element(%custom-call.73.remat), index=0
  ROOT %add.3 = bf16[32768,7168]{{1,0}} add(%gte.1, %gte.2)
}}
"""


def test_cublas_calls_of_an_autotuned_compile_count_as_gemms() -> None:
    found = remat_gemms.analyse(CUBLAS_TEXT)
    one = 2 * 32768 * 14336 * 7168
    assert (found.total_flops, found.remat_flops) == (2 * one, one)
    assert found.by_shape == {"[32768,7168] K=14336": one}


def test_a_dump_without_the_module_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="xla_dump_hlo_as_text"):
        remat_gemms.find(tmp_path)
    with pytest.raises(UserError, match="ENTRY"):
        remat_gemms.analyse("HloModule empty\n")
