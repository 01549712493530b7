"""One grouped-GEMM interface over three backends: `out[rows of group g] = x[rows of g] @ w[g]`.

Why: MaxText 0.2.5 reaches `jax.lax.ragged_dot` (dense work on GPU) or tokamax's Mosaic kernel, but not
TE's `grouped_dense`, the fastest of the three on Hopper (docs/PERFORMANCE.md), outside its fused
`te_moe_block`, which refuses DeepSeek-V3's bias update. This module lets our layer pick the kernel per
run, with the same inputs and the same semantics.

Rows of `x_sorted` are ordered by group; `group_sizes[g]` rows belong to group g; the sizes sum to the
number of rows (the layer checks that: dropless).

FP8 (`fp8="current_scaling"`, backend te only): MaxText's TE block offers FP8 experts only as MXFP8, which
needs Blackwell, so Hopper gets none there. TE's `grouped_dense` also takes per-tensor current scaling
(E4M3 forward, E5M2 gradients), which Hopper runs given two things: a quantizer set built with explicit
dtypes, and every group's row count a multiple of 16 counted inside `group_sizes`
(`align.py` pads with zero rows and drops them after the GEMM). `fp8="mxfp8"` is TE's block-scaled FP8 for
Blackwell, inside our block, so DeepSeek-V3's routing keeps MXFP8 experts there.
"""

from __future__ import annotations

import functools
import importlib
import logging
from types import ModuleType
from typing import Literal

import jax
import jax.numpy as jnp

from maxtext_moe.errors import UserError
from maxtext_moe.moe.align import aligned
from maxtext_moe.moe.settings import BACKENDS, FP8_MODES, Backend, Fp8, Fp8Cast
from maxtext_moe.upstream import te, te_group_scales
from maxtext_moe.upstream.opaque_vjp import opaque_vjp

# TE's FP8 grouped GEMM on Hopper asserts `lda % 16 == 0` per group; TE casts a group with its tuned kernel only
# when its rows are a multiple of 32, and sends the others to a general one (45 ms a step on the FP8 proxy).
# Groups padded to 32 rows: 1.290 s a step against 1.310 s at 16 on one H200, with the fused up-projection tree
# (docs/PERFORMANCE.md).
FP8_GROUP_ALIGN = 32
# MXFP8 scales cover 32-element blocks and TE tiles them 128 rows at a time: groups padded to 128 rows.
MXFP8_GROUP_ALIGN = 128
# The remat name of what TE's FP8 grouped GEMM keeps for its backward pass: the transposed FP8 casts of its
# input and weights, and their scales. A policy that saves it spares the backward pass the permutation and
# the casts of every expert GEMM (`upstream/remat.py`).
FP8_OPERANDS = "moe_fp8_operands"


def group_align(fp8: Fp8) -> int:
    """Rows each expert group is padded to a multiple of before the grouped GEMM runs in mode `fp8`."""
    return {"current_scaling": FP8_GROUP_ALIGN, "mxfp8": MXFP8_GROUP_ALIGN}.get(fp8, 1)


TePath = Literal["v1", "v2"]
# TE's single-kernel grouped GEMM ("V2", nvte_grouped_gemm) needs cuBLASLt >= 13.4 on Hopper; TE enables it
# from its compile-time cuBLAS version, so a wheel built against 13.4 fails at run time on an older library.
TE_V2_MIN_CUBLASLT = 130400

log = logging.getLogger(__name__)


def te_grouped_gemm_path(runtime_cublaslt: int, compiled_v2: bool, requested: str = "auto") -> TePath:
    """Decide which TE grouped-GEMM path may run: "v2" (one cuBLAS grouped kernel) or "v1" (one GEMM per group).

    `requested` is "auto" (V2 when TE was built with it and the runtime cuBLASLt is new enough), "v1"
    (always allowed), or "v2" (refused when it cannot run, rather than failing inside a kernel launch).
    """
    v2_runs = compiled_v2 and runtime_cublaslt >= TE_V2_MIN_CUBLASLT
    if requested == "v1":
        return "v1"
    if requested == "auto":
        return "v2" if v2_runs else "v1"
    if requested == "v2":
        if not v2_runs:
            raise UserError(
                f"TE's grouped GEMM V2 needs a TE build with it and cuBLASLt >= {TE_V2_MIN_CUBLASLT}; this machine has "
                f"cuBLASLt {runtime_cublaslt} (TE built with V2: {compiled_v2}).",
                fix="use te_gemm_path='auto' or 'v1', or install cuBLAS >= 13.4.",
            )
        return "v2"
    raise UserError(f"unknown TE grouped-GEMM path {requested!r}.", fix="use 'auto', 'v1' or 'v2'.")


@functools.cache
def select_te_grouped_gemm_path(requested: str = "auto") -> TePath:
    """Apply `te_grouped_gemm_path` to the TE in this process, once per process; returns the path chosen.
    Images with cuBLAS >= 13.4 keep V2 under "auto"; the switch itself is `upstream.te.use_per_group_gemm`."""
    runtime = te.runtime_cublaslt()
    compiled_v2 = te.v2_grouped_gemm_compiled()
    path = te_grouped_gemm_path(runtime, compiled_v2, requested)
    if path == "v1" and compiled_v2:
        te.use_per_group_gemm(f"per-group path ({requested}, cuBLASLt {runtime})")
    log.info("TE grouped GEMM path: %s (requested %s, runtime cuBLASLt %d)", path, requested, runtime)
    return path


def _te_fp8(
    dense: ModuleType,
    x_sorted: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    mode: Fp8,
    groups_aligned: bool,
    cast: Fp8Cast = "te",
) -> jax.Array:
    """TE's `grouped_dense` with FP8 operands: per-tensor current scaling (the amax of this call, E4M3 forward
    and E5M2 gradients; no scaling state to keep), or MXFP8 (E4M3 with one power-of-two scale per 32
    elements, TE's default MXFP8 recipe; Blackwell only, not yet run by this project).

    The dtypes are given explicitly: built from the scaling mode alone, TE's quantizer set does not run
    on Hopper. Groups are padded around the call (`align.aligned`) to the rows the mode needs, unless the
    caller has padded them (`groups_aligned`). `cast`: who casts the operands under current scaling (TE's
    grouped quantize or XLA: `upstream/te_group_scales.py`).
    """
    quantize = importlib.import_module("transformer_engine.jax.quantize")
    mxfp8 = mode == "mxfp8"
    if not mxfp8:
        te_group_scales.install(cast)
    quantizers = quantize.QuantizerFactory.create_set(
        scaling_mode=quantize.ScalingMode.MXFP8_1D_SCALING if mxfp8 else quantize.ScalingMode.CURRENT_TENSOR_SCALING,
        fwd_dtype=jnp.float8_e4m3fn,
        bwd_dtype=jnp.float8_e4m3fn if mxfp8 else jnp.float8_e5m2,
        n_groups=w.shape[0],
    )
    gemm = opaque_vjp(
        lambda xp, wp, sizes: dense.grouped_dense(xp, wp, sizes, quantizer_set=quantizers), 2, FP8_OPERANDS
    )
    if groups_aligned:
        return gemm(x_sorted, w, group_sizes).astype(x_sorted.dtype)
    return aligned(gemm, x_sorted, w, group_sizes, group_align(mode)).astype(x_sorted.dtype)


def grouped_matmul(
    x_sorted: jax.Array,
    w: jax.Array,
    group_sizes: jax.Array,
    backend: Backend,
    fp8: Fp8 = "none",
    *,
    partial: bool = False,
    groups_aligned: bool = False,
    fp8_cast: Fp8Cast = "te",
) -> jax.Array:
    """[M, K] rows sorted by group, [G, K, N] weights, [G] int32 sizes -> [M, N] in `x_sorted.dtype`.

    Accumulation is float32 in every backend. tokamax runs its Mosaic GPU kernel on GPU (what MaxText's
    `use_tokamax_gmm=true` calls) and its XLA implementation elsewhere (Mosaic GPU has no CPU target).
    `fp8="current_scaling"` or `"mxfp8"` quantizes both operands to FP8 inside TE's grouped GEMM (backend te
    only; see `_te_fp8`); "none" computes in `x_sorted.dtype`.

    `partial=True` when the sizes may sum to less than M (the expert-parallel receive buffer): see
    `_tail_guarded`. With the default the caller promises they sum to M (the one-device layer).
    `groups_aligned=True`: the caller has padded every group to `group_align(fp8)` rows and the groups cover
    all M rows, so an FP8 GEMM needs no padding of its own (several GEMMs on the same rows pad them once).
    `fp8_cast`: who casts the operands under current scaling ("te" or "xla", see `_te_fp8`).
    """
    if fp8 not in FP8_MODES:
        raise UserError(f"unknown FP8 mode {fp8!r} for the expert GEMMs.", fix=f"choose one of {', '.join(FP8_MODES)}.")
    if fp8 != "none" and backend != "te":
        raise UserError(
            f"FP8 {fp8} expert GEMMs run on TE's grouped GEMM only, not on backend {backend!r}.",
            fix="use backend 'te', or fp8 'none'.",
        )
    if x_sorted.ndim != 2 or w.ndim != 3 or x_sorted.shape[1] != w.shape[1] or group_sizes.shape != (w.shape[0],):
        raise UserError(
            f"grouped_matmul shapes do not fit: x {x_sorted.shape}, w {w.shape}, "
            f"group_sizes {group_sizes.shape}; want [M,K], [G,K,N], [G]."
        )
    group_sizes = group_sizes.astype(jnp.int32)
    w = w.astype(x_sorted.dtype)
    if partial and backend != "ragged_dot":
        return _tail_guarded(x_sorted, w, group_sizes, backend, fp8, fp8_cast)
    if backend == "ragged_dot":
        return jax.lax.ragged_dot(x_sorted, w, group_sizes, preferred_element_type=x_sorted.dtype)
    if backend == "tokamax":
        import tokamax

        on_gpu = jax.devices()[0].platform == "gpu"
        return tokamax.ragged_dot(
            x_sorted,
            w,
            group_sizes=tokamax.RaggedDotGroupSizes(group_sizes, x_sorted.shape[0]),
            precision=jax.lax.Precision.DEFAULT,
            preferred_element_type=x_sorted.dtype,
            implementation="mosaic" if on_gpu else None,
        )
    if backend == "te":
        dense, _ = te.import_te()
        select_te_grouped_gemm_path()
        if fp8 != "none":
            return _te_fp8(dense, x_sorted, w, group_sizes, fp8, groups_aligned, fp8_cast)
        return opaque_vjp(dense.grouped_dense, 2)(x_sorted, w, group_sizes).astype(x_sorted.dtype)
    raise UserError(f"unknown grouped-GEMM backend {backend!r}.", fix=f"choose one of {', '.join(BACKENDS)}.")


def _tail_guarded(
    x_sorted: jax.Array, w: jax.Array, group_sizes: jax.Array, backend: Backend, fp8: Fp8, fp8_cast: Fp8Cast
) -> jax.Array:
    """The grouped GEMM when the groups end before row M: rows past them give zero outputs and take zero
    gradients, as `jax.lax.ragged_dot` defines it, whatever the kernel does with them.

    Why: tokamax's Mosaic GPU kernel leaves those output rows unwritten (it has no `zero_initialize`), and
    so does its backward for the input gradient; whatever that memory holds (NaN included) would reach
    the gradients. TE asserts that the groups cover all M
    rows, so for TE the tail joins the last group: its rows are zeroed first, so they add nothing to that
    expert's weight gradient, but they are computed.
    """
    tail = jnp.arange(x_sorted.shape[0]) >= jnp.sum(group_sizes)
    x_sorted = jnp.where(tail[:, None], 0, x_sorted)
    if backend == "te":
        group_sizes = group_sizes.at[-1].add(x_sorted.shape[0] - jnp.sum(group_sizes))
    out = grouped_matmul(x_sorted, w, group_sizes, backend, fp8, fp8_cast=fp8_cast)
    return jnp.where(tail[:, None], 0, out)
