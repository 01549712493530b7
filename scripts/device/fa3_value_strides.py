"""Give FA3's JAX binding the strides of values narrower than queries and keys (MLA: 128 under 192).

The gap: flash-attn3-jax (v0.2.3) builds the strides of V, O, dO and dV from the query head width, so with
192-wide Q and K and 128-wide V the kernels would read and write those tensors at 192 columns a row.
FA3's own kernels take the widths apart (`params.dv`); only the binding's stride setup assumes one width.
This adds one function to the binding's flash.cpp that sets those strides from V's width, and calls it in
the forward and the backward after the widths are known (dense [batch, seq, heads, dim] tensors only; the
varlen and paged layouts are not built for MLA here).

Usage: python3 fa3_value_strides.py path/to/csrc/flash_attn/flash.cpp  (idempotent)
"""

from __future__ import annotations

import sys
from pathlib import Path

MARK = "// maxtext-moe: value strides"
HELPER = f"""
{MARK}: V, O, dO and dV are dense [batch, seq, heads, head width of V].
#include <type_traits>
template <typename Params>
static void set_value_strides(Params &params, int64_t seqlen_q, int64_t seqlen_k, int64_t h, int64_t h_k,
                              int64_t d_v) {{
  params.v_row_stride = h_k * d_v;
  params.v_head_stride = d_v;
  params.v_batch_stride = seqlen_k * h_k * d_v;
  params.o_row_stride = h * d_v;
  params.o_head_stride = d_v;
  params.o_batch_stride = seqlen_q * h * d_v;
  if constexpr (std::is_same_v<Params, Flash_bwd_params>) {{
    params.do_row_stride = params.o_row_stride;
    params.do_head_stride = params.o_head_stride;
    params.do_batch_stride = params.o_batch_stride;
    params.dv_row_stride = params.v_row_stride;
    params.dv_head_stride = params.v_head_stride;
    params.dv_batch_stride = params.v_batch_stride;
  }}
}}
"""
ANCHOR = "  params.dv_rounded = head_size_v_rounded;\n  params.is_bf16 = (dtype == ffi::DataType::BF16);\n"
FORWARD_CALL = (
    "  if (!is_varlen_q && !is_varlen_k && !paged_KV)\n"
    "    set_value_strides(params, seqlen_q, seqlen_k, num_heads, num_heads_k, head_size_v);\n"
)
BACKWARD_CALL = (
    "  if (!is_varlen)\n    set_value_strides(params, seqlen_q, seqlen_k, num_heads, num_heads_k, head_size_v);\n"
)
FIRST_HANDLER = "ffi::Error set_params_fprop("


def patch(text: str) -> str:
    if MARK in text:
        return text
    if text.count(ANCHOR) != 2 or text.count(FIRST_HANDLER) != 1:
        raise SystemExit("fa3_value_strides: flash.cpp is not the flash-attn3-jax v0.2.3 source this patch expects")
    head, forward, backward = text.split(ANCHOR)
    head = head.replace(FIRST_HANDLER, HELPER + "\n" + FIRST_HANDLER, 1)
    return head + ANCHOR + FORWARD_CALL + forward + ANCHOR + BACKWARD_CALL + backward


def main() -> None:
    path = Path(sys.argv[1])
    path.write_text(patch(path.read_text()))


if __name__ == "__main__":
    main()
