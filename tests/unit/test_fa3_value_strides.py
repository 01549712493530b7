"""The build's patch to FA3's JAX binding: V, O, dO and dV strides from V's own head width, set in the forward
and the backward after the widths are known; applied once, and refused on a source it was not written for."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("fa3_value_strides", REPO / "scripts/device/fa3_value_strides.py")
fa3_value_strides = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fa3_value_strides)

ANCHOR = fa3_value_strides.ANCHOR
# The shape of the binding's flash.cpp where the patch goes: the stride setup, then the forward and backward
# handlers, each setting the value width before the dtype.
SOURCE = (
    "#include <x>\nffi::Error set_params_fprop(Flash_fwd_params &params) {}\n"
    "ffi::Error mha_fwd_impl() {\n  params.dv = head_size_v;\n" + ANCHOR + "  forward_rest();\n}\n"
    "ffi::Error mha_bwd_impl() {\n  params.dv = head_size_v;\n" + ANCHOR + "  backward_rest();\n}\n"
)


def test_patch_sets_value_strides_in_both_handlers_after_the_widths() -> None:
    out = fa3_value_strides.patch(SOURCE)
    assert out.index("set_value_strides(Params &params") < out.index("ffi::Error set_params_fprop(")
    forward, backward = out.split("ffi::Error mha_bwd_impl()")
    assert (
        forward.index(ANCHOR)
        < forward.index("if (!is_varlen_q && !is_varlen_k && !paged_KV)")
        < forward.index("forward_rest")
    )
    assert backward.index(ANCHOR) < backward.index("if (!is_varlen)") < backward.index("backward_rest")
    assert out.count("set_value_strides(params, seqlen_q, seqlen_k, num_heads, num_heads_k, head_size_v);") == 2
    assert fa3_value_strides.patch(out) == out  # a second build run leaves it as it is


def test_patch_refuses_another_version_of_the_binding() -> None:
    with pytest.raises(SystemExit, match="not the flash-attn3-jax v0.2.3 source"):
        fa3_value_strides.patch(SOURCE.replace(ANCHOR, "", 1))
