"""FlashAttention-3 for MLA's head widths (192-wide queries and keys, 128-wide values), called through XLA FFI,
and MaxText's cuDNN attention swapped for it in training (`attention.kernel: fa3`).

The gap: MaxText 0.2.5 and JAX reach cuDNN's and TE's attention kernels, not FA3. FA3's JAX binding
(flash-attn3-jax) registers FA3's forward and backward as XLA FFI targets, but its Python side requires K and V
of one shape and its wheels hold head width 128 alone. `scripts/device/build_fa3_carry.sh` builds the binding's
library for MLA's widths; this module calls its two FFI targets itself, with V narrower than Q and K, under
a custom VJP whose residuals are the forward's output and log-sum-exp (what FA3's backward reads).

Layout BTNH ([batch, seq, heads, dim]), causal, BF16, no dropout: MaxText's training attention for DeepSeek-V3.
Decoding and prefill keep MaxText's cuDNN path. Under a device mesh the kernel runs on each device's shard
(`jax.shard_map`) with the batch and heads split as MaxText's rules say (that path has not run on more than one
GPU yet); a sharded sequence (context parallelism) is refused, as the kernel sees whole sequences only. FA3's
backward takes a float32 scratch of batch x heads x sequence x 192 from XLA's allocator at run time, which
XLA's compile does not count.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtext_moe.errors import UserError

LIBRARY = "flash_attn3_jax_lib.flash_api"
FORWARD_TARGET = "flash_mha_fwd"
BACKWARD_TARGET = "flash_mha_bwd"
BUILD = "scripts/device/build_fa3_carry.sh"
CUDA_RUNTIME = "libcudart.so.13"
# FA3's backward writes its softmax statistics padded to whole 128-row blocks of the sequence.
LSE_BLOCK = 128

log = logging.getLogger(__name__)


@functools.cache
def load() -> str:
    """Import the FA3 library and register its FFI targets with JAX (once per process); returns the build's
    description (its BUILD_INFO, or the module path)."""
    try:
        _load_cuda_runtime()
        lib = importlib.import_module(LIBRARY)
    except ImportError as e:
        raise UserError(
            f"attention.kernel: fa3 needs FlashAttention-3's XLA library ({LIBRARY}), which does not load: {e}.",
            fix=f"build it with {BUILD} and put the unpacked folder on PYTHONPATH, or use attention.kernel: cudnn.",
        ) from e
    for name, capsule in lib.get_ffi_registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return build_info() or str(lib.__file__)


def build_info() -> str | None:
    """What FA3 build Python would import (its BUILD_INFO, one line), without importing it; None when absent.
    `doctor` reports it on any machine, a CPU one included."""
    spec = importlib.util.find_spec(LIBRARY.split(".")[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    info = folder.parent / "BUILD_INFO"
    if not any(folder.glob("flash_api*.so")):
        return None
    return info.read_text().strip().replace("\n", "; ") if info.exists() else str(folder)


def _load_cuda_runtime() -> None:
    """Load the CUDA runtime the library links (libcudart.so.13) from where JAX's CUDA wheels or the toolkit
    keep it, so the library loads without LD_LIBRARY_PATH; nothing happens when the loader finds it itself."""
    candidates = [Path(p) / "lib" for p in _module_paths("nvidia.cu13")]
    candidates += [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "lib64"]
    for lib in candidates:
        runtime = lib / CUDA_RUNTIME
        if runtime.exists():
            ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)
            return


def _module_paths(name: str) -> list[str]:
    try:
        return list(importlib.import_module(name).__path__)
    except ImportError:
        return []


def _empty(dtype: Any) -> jax.Array:
    """A zero-size buffer: the binding reads an absent optional input as one with no elements."""
    return jnp.zeros((0,), dtype)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """FA3's causal forward: the output [b, s, h, d_v] and the log-sum-exp of each row [b, h, s] (float32)."""
    b, s, h, _ = q.shape
    out_types = (
        jax.ShapeDtypeStruct((b, s, h, v.shape[-1]), q.dtype),
        jax.ShapeDtypeStruct((b, h, s), jnp.float32),
        jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),  # split-KV partials: no splits here
        jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
    )
    i32, f32, same = _empty(jnp.int32), _empty(jnp.float32), _empty(q.dtype)
    # Optional inputs in the binding's order: k_new, v_new, q_v, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
    # seqused_q, seqused_k, page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary,
    # q/k/v descales, scheduler metadata.
    optional = (same, same, same, i32, i32, i32, i32, i32, i32, i32, i32, same, same, i32, f32, f32, f32, i32)
    out, lse, _, _ = jax.ffi.ffi_call(FORWARD_TARGET, out_types)(
        q, k, v, *optional,
        max_seqlen_q=s, max_seqlen_q_has_value=True, max_seqlen_k=s, max_seqlen_k_has_value=True,
        softmax_scale_val=float(scale), softmax_scale_has_value=True, pack_gqa_val=False,
        pack_gqa_has_value=False, is_causal=True, window_size_left=-1, window_size_right=0, attention_chunk=0,
        softcap=0.0, is_rotary_interleaved=False, num_splits=1, sm_margin=0,
    )  # fmt: skip
    return out, lse


def _backward(
    dout: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, s, h, _ = q.shape
    rows = -(-s // LSE_BLOCK) * LSE_BLOCK
    out_types = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct((b, h, rows), jnp.float32),  # FA3's scratch: sum(dO * O) per row
        jax.ShapeDtypeStruct((b, h, rows), jnp.float32),  # and the log-sum-exp in base 2
    )
    i32 = _empty(jnp.int32)
    dq, dk, dv, _, _ = jax.ffi.ffi_call(BACKWARD_TARGET, out_types)(
        dout, q, k, v, out, lse, i32, i32, i32, i32,
        max_seqlen_q_val=s, max_seqlen_q_has_value=True, max_seqlen_k_val=s, max_seqlen_k_has_value=True,
        softmax_scale_val=float(scale), softmax_scale_has_value=True, is_causal=True, window_size_left=-1,
        window_size_right=0, softcap=0.0, deterministic=False, sm_margin=0,
    )  # fmt: skip
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """Causal attention softmax(scale * q k^T) v with FA3: q, k [b, s, h, d_qk], v [b, s, h, d_v] in BF16."""
    return _forward(q, k, v, scale)[0]


def _flash_fwd(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    out, lse = _forward(q, k, v, scale)
    return out, (q, k, v, out, lse)


def _flash_bwd(scale: float, res: tuple[jax.Array, ...], dout: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, out, lse = res
    return _backward(dout.astype(out.dtype), q, k, v, out, lse, scale)


flash_attention.defvjp(_flash_fwd, _flash_bwd)


def check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """Refuse what this build does not run, before XLA would fail inside the kernel launch."""
    if q.dtype != jnp.bfloat16 or k.dtype != q.dtype or v.dtype != q.dtype:
        raise UserError(
            f"attention.kernel: fa3 runs BF16 attention; got {q.dtype}, {k.dtype}, {v.dtype}.",
            fix="train in BF16 activations (dtype: bfloat16), or use attention.kernel: cudnn.",
        )
    if q.shape[-1] != 192 or k.shape[-1] != 192 or v.shape[-1] != 128 or q.shape[:-1] != v.shape[:-1]:
        raise UserError(
            f"attention.kernel: fa3 is built for MLA's head widths (192, 128); got q {q.shape}, k {k.shape}, "
            f"v {v.shape}.",
            fix=f"use attention.kernel: cudnn for this model, or extend the kernel list of {BUILD}.",
        )


def is_forward(prim: Any, params: dict[str, Any]) -> bool:
    """Whether a traced primitive is this module's forward kernel (what `attention.residuals: save` keeps)."""
    return prim.name == "ffi_call" and params.get("target_name") == FORWARD_TARGET


def _sharded(op: Any, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`flash_attention` on each device's shard, split as MaxText's logical rules split attention's activations.

    `op` is MaxText's AttentionOp (its mesh and rules); MaxText scales the queries before attention, so the
    kernel's scale is 1."""
    from maxtext.common.common_types import BATCH_ATTN, D_KV, HEAD, LENGTH

    spec = op._logical_to_mesh_axes((BATCH_ATTN, LENGTH, HEAD, D_KV))
    if spec[1] is not None:
        raise UserError(
            f"attention.kernel: fa3 sees whole sequences, but the sequence is split over mesh axis {spec[1]!r} "
            "(context parallelism).",
            fix="use attention.kernel: cudnn with context parallelism.",
        )
    run = functools.partial(flash_attention, scale=1.0)
    if op.mesh.size == 1:
        return run(q, k, v)
    return jax.shard_map(run, mesh=op.mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)


def install() -> None:
    """Make MaxText's training attention (`attention: cudnn_flash_jax`, causal) run FA3 from now on in this
    process; decoding keeps cuDNN. Fails here, before compute, when the library does not load."""
    from maxtext.common.common_types import MODEL_MODE_AUTOREGRESSIVE, MODEL_MODE_TRAIN
    from maxtext.layers.attention_op import AttentionOp

    original = AttentionOp.cudnn_jax_flash_attention
    if getattr(original, "runs_fa3", False):
        return
    info = load()

    @functools.wraps(original)
    def attention(
        self: Any, query: jax.Array, key: jax.Array, value: jax.Array, decoder_segment_ids: Any,
        model_mode: str = MODEL_MODE_TRAIN,
    ) -> tuple[jax.Array, Any]:  # fmt: skip
        if model_mode == MODEL_MODE_AUTOREGRESSIVE:
            return original(self, query, key, value, decoder_segment_ids, model_mode)
        check_shapes(query, key, value)
        # MaxText's caller reads only the output in training; the statistics stay inside the custom VJP.
        return checkpoint_name(_sharded(self, query, key, value), "context"), None

    attention.runs_fa3 = True  # type: ignore[attr-defined]
    AttentionOp.cudnn_jax_flash_attention = attention
    log.info("attention: FlashAttention-3 (%s) runs MaxText's training attention", info)
