"""The bytes a compiled step's memory-bound kernels move: from a real XLA:CPU dump (a fusion in the entry
computation and one in a loop body run N times), and from HLO text shaped as XLA:GPU writes a training step
(a multi-output fusion whose second output is copied, a GEMM fusion, TE's cast and GEMM as custom calls)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from maxtext_moe.plan import memory_traffic

M, N, STEPS = 256, 512, 5


def step(x: jax.Array) -> jax.Array:
    """One elementwise pass over [M, N] float32, then STEPS more in a loop XLA keeps as a while loop."""
    return jax.lax.fori_loop(0, STEPS, lambda _, h: jnp.sin(h) * 2, jnp.cos(x) * 3)


def test_a_real_dump_counts_each_pass_once_and_loop_bodies_by_their_trip_count(tmp_path: Path) -> None:
    options = {"xla_dump_to": str(tmp_path), "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_step"}
    jax.jit(step).lower(jnp.ones((M, N))).compile(options)
    found = memory_traffic.find(tmp_path, module="jit_step")
    one_pass = 2 * M * N * 4  # read and write [M, N] float32
    assert (1 + STEPS) * one_pass <= found.xla_bytes < (1 + STEPS) * one_pass * 1.01  # + the loop counter
    assert found.cast_bytes == 0


GPU_TEXT = """HloModule jit_train_step

%upd (p0: bf16[64,32], p1: bf16[64,32], p2: bf16[64,64]) -> (bf16[64,32], bf16[64,32]) {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  %p2 = bf16[64,64]{1,0} parameter(2)
  %s0 = bf16[64,32]{1,0} slice(%p2), slice={[0:64], [0:32]}
  %s1 = bf16[64,32]{1,0} slice(%p2), slice={[0:64], [32:64]}
  %a0 = bf16[64,32]{1,0} subtract(%p0, %s0)
  %a1 = bf16[64,32]{1,0} subtract(%p1, %s1)
  ROOT %t = (bf16[64,32]{1,0}, bf16[64,32]{1,0}) tuple(%a0, %a1)
}

%gemm_fusion_dot.1_computation (q0: bf16[64,32], q1: bf16[32,64]) -> bf16[64,64] {
  %q0 = bf16[64,32]{1,0} parameter(0)
  %q1 = bf16[32,64]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,64]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w0: bf16[64,32], w1: bf16[64,32], x: bf16[64,32], y: bf16[32,64]) -> (bf16[64,32], bf16[64,32]) {
  %w0 = bf16[64,32]{1,0} parameter(0)
  %w1 = bf16[64,32]{1,0} parameter(1)
  %x = bf16[64,32]{1,0} parameter(2)
  %y = bf16[32,64]{1,0} parameter(3)
  %g = bf16[64,64]{1,0} fusion(%x, %y), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %quantize = (f8e4m3fn[64,32]{1,0}, f32[1]{0}) custom-call(%x), custom_call_target="te_grouped_quantize_ffi"
  %gemm = bf16[64,64]{1,0} custom-call(%quantize#0, %y), custom_call_target="te_grouped_gemm_ffi"
  %update = (bf16[64,32], bf16[64,32]) fusion(%w0, %w1, %g), kind=kLoop, calls=%upd, metadata={op_name="sub"}
  %copy.1 = bf16[64,32]{1,0} copy(%update#1)
  %update.0 = bf16[64,32]{1,0} get-tuple-element(%update), index=0
  ROOT %out = (bf16[64,32]{1,0}, bf16[64,32]{1,0}) tuple(%update.0, %copy.1)
}
"""


def test_gpu_text_counts_fusions_copies_and_casts_and_leaves_gemms_out() -> None:
    found = memory_traffic.analyse(GPU_TEXT)
    half, whole = 64 * 32 * 2, 64 * 64 * 2
    update = 2 * half + whole + 2 * half  # reads both weights and the whole gradient, writes two outputs
    copy = 2 * half  # one tuple member read, written again
    assert found.xla_bytes == update + copy
    assert found.by_op == {"step sub": update, "unnamed copy": copy}
    assert found.cast_bytes == half + (64 * 32 + 4)  # TE's cast: BF16 in, FP8 and its scale out
    assert "XLA's fusions and copies 0.0 GB" in found.render() and "step sub" in found.render()


CALL_TEXT = """HloModule jit_train_step

%inner (a: f32[16,16]) -> f32[16,16] {
  %a = f32[16,16]{1,0} parameter(0)
  ROOT %c = f32[16,16]{1,0} copy(%a)
}

ENTRY %main (x: f32[16,16]) -> f32[16,16] {
  %x = f32[16,16]{1,0} parameter(0)
  ROOT %r = f32[16,16]{1,0} call(%x), to_apply=%inner
}
"""


def test_what_a_call_runs_counts_once() -> None:
    assert memory_traffic.analyse(CALL_TEXT).by_op == {"unnamed copy": 2 * 16 * 16 * 4}
