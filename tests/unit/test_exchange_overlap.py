"""`plan.exchange_overlap`: the all-to-alls of a compiled step and what XLA scheduled inside each.

XLA:CPU compiles a real expert-style exchange here (its all-to-alls are synchronous); the asynchronous form
is XLA:GPU's, whose scheduled text is below as XLA writes it (names shortened), and the deviceless EP2
compile in tests/gpu/test_plan_compile_gpu.py reads a real one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from maxtext_moe.plan import exchange_overlap

EXCHANGE = """
import sys
import jax, jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

def step(a):  # dispatch, a GEMM on what arrived, combine
    there = jax.lax.all_to_all(a, "x", 0, 0, tiled=True)
    return jax.lax.all_to_all(there @ a.T @ a, "x", 0, 0, tiled=True)

mesh = Mesh(jax.devices(), ("x",))
f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
options = {"xla_dump_to": sys.argv[1], "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_step"}
f.lower(jnp.ones((8, 16), jnp.float32)).compile(options)
"""

# The two all-to-alls XLA:GPU wraps in async computations, as the scheduled text below calls them.
ASYNC_ALL_TO_ALLS = """HloModule jit_train_step, is_scheduled=true

%async_computation.1 (p: bf16[64,7168]) -> bf16[64,7168] {
  %p = bf16[64,7168]{1,0} parameter(0)
  ROOT %all-to-all.1 = bf16[64,7168]{1,0} all-to-all(%p), channel_id=1, replica_groups={{0,1}}, dimensions={0}
}

%async_computation.2 (q: bf16[64,7168]) -> bf16[64,7168] {
  %q = bf16[64,7168]{1,0} parameter(0)
  ROOT %all-to-all.2 = bf16[64,7168]{1,0} all-to-all(%q), channel_id=2, replica_groups={{0,1}}, dimensions={0}
}
"""

SCHEDULED = (
    ASYNC_ALL_TO_ALLS
    + """
ENTRY %main.1 (x: bf16[64,7168], w: bf16[7168,2048]) -> bf16[64,7168] {
  %x = bf16[64,7168]{1,0} parameter(0)
  %w = bf16[7168,2048]{1,0} parameter(1)
  %all-to-all-start.1 = ((bf16[64,7168]{1,0}), bf16[64,7168]{1,0}) async-start(%x), calls=%async_computation.1
  %gemm_fusion_dot.7 = bf16[64,2048]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_fusion_dot.7_computation
  %te_grouped_gemm_ffi.3 = (bf16[64,2048]{1,0}) custom-call(%x, %w), custom_call_target="te_grouped_gemm_ffi"
  %loop_select_fusion.4 = bf16[64,2048]{1,0} fusion(%te_grouped_gemm_ffi.3#0), kind=kLoop, calls=%fused_select.4
  %all-to-all-done.1 = bf16[64,7168]{1,0} async-done(%all-to-all-start.1)
  %all-to-all-start.2 = ((bf16[64,7168]), bf16[64,7168]) async-start(%all-to-all-done.1), calls=%async_computation.2
  %loop_convert_fusion.5 = bf16[64,7168]{1,0} fusion(%x), kind=kLoop, calls=%fused_convert.5
  ROOT %all-to-all-done.2 = bf16[64,7168]{1,0} async-done(%all-to-all-start.2)
}
"""
)


def test_a_cpu_compiled_exchange_is_two_synchronous_all_to_alls(tmp_path: Path) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    subprocess.run([sys.executable, "-c", EXCHANGE, str(tmp_path)], env=env, check=True, timeout=300)
    found = exchange_overlap.find(tmp_path, module="jit_step")
    assert found is not None and found.windows == [] and found.synchronous == 2
    assert found.render().startswith("all-to-all: 2 in the step, 0 asynchronous; 0 with a GEMM")


def test_each_asynchronous_all_to_all_counts_the_gemms_scheduled_inside_it() -> None:
    found = exchange_overlap.read(SCHEDULED)
    assert found is not None and found.synchronous == 0
    # The dispatch hides behind a cuBLAS GEMM fusion and a TE grouped GEMM (the select that reads the grouped
    # GEMM's output is not one); the combine has only an elementwise fusion inside: exposed.
    assert found.windows == [exchange_overlap.Window(3, 1, 1), exchange_overlap.Window(1, 0, 0)]
    assert "2 in the step, 2 asynchronous; 1 with a GEMM" in found.render() and "1 with none" in found.render()
    assert found.to_json()["windows"][1] == {"instructions": 1, "dense_gemms": 0, "grouped_gemms": 0, "in_loop": False}


def test_a_step_without_all_to_alls_has_no_exchange_to_report() -> None:
    one_device = "HloModule m\n\nENTRY %m (x: f32[]) -> f32[] {\n  ROOT %x = f32[] parameter(0)\n}\n"
    assert exchange_overlap.read(one_device) is None


SCANNED = (
    ASYNC_ALL_TO_ALLS
    + """
%body.3 (carry: (s32[], bf16[64,7168])) -> (s32[], bf16[64,7168]) {
  %carry = (s32[], bf16[64,7168]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %h = bf16[64,7168]{1,0} get-tuple-element(%carry), index=1
  %all-to-all-start.1 = ((bf16[64,7168]{1,0}), bf16[64,7168]{1,0}) async-start(%h), calls=%async_computation.1
  %te_grouped_gemm_ffi.3 = (bf16[64,7168]{1,0}) custom-call(%h), custom_call_target="te_grouped_gemm_ffi"
  %all-to-all-done.1 = bf16[64,7168]{1,0} async-done(%all-to-all-start.1)
  ROOT %tuple.4 = (s32[], bf16[64,7168]{1,0}) tuple(%i, %all-to-all-done.1)
}

%condition.5 (c: (s32[], bf16[64,7168])) -> pred[] {
  %c = (s32[], bf16[64,7168]{1,0}) parameter(0)
  ROOT %constant.6 = pred[] constant(true)
}

ENTRY %main.1 (x: bf16[64,7168]) -> bf16[64,7168] {
  %x = bf16[64,7168]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,7168]{1,0}) tuple(%zero, %x)
  %while.7 = (s32[], bf16[64,7168]{1,0}) while(%init), condition=%condition.5, body=%body.3
  %out = bf16[64,7168]{1,0} get-tuple-element(%while.7), index=1
  %all-to-all-start.2 = ((bf16[64,7168]), bf16[64,7168]) async-start(%out), calls=%async_computation.2
  %loop_convert_fusion.5 = bf16[64,7168]{1,0} fusion(%x), kind=kLoop, calls=%fused_convert.5
  ROOT %all-to-all-done.2 = bf16[64,7168]{1,0} async-done(%all-to-all-start.2)
}
"""
)


def test_the_all_to_alls_of_a_scanned_layer_loop_count_once_per_loop_body() -> None:
    """Scanned layers put each layer's exchanges in a while loop's body, which runs once per layer: they are
    read there too, marked as in a loop, beside the step's own."""
    found = exchange_overlap.read(SCANNED)
    assert found is not None and found.synchronous == 0
    assert found.windows == [exchange_overlap.Window(1, 0, 0), exchange_overlap.Window(1, 0, 1, in_loop=True)]
    assert "2 in the step's code (1 in loop bodies, run once an iteration)" in found.render()
