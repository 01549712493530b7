"""Run chosen MLA projections in BF16 under TE's FP8 recipes (`attention.bf16_projections`).

The gap: MaxText's `quantization: te_fp8_currentscaling` gives every dense GEMM TE's FP8 alike, and has no
per-layer choice (its `unquantized_modules` sets how FP8-stored weights are kept, not which GEMMs compute in
FP8). TE's per-tensor current scaling reads each operand once for its amax and again for its cast, and the
gradient too; for MLA's key-value projections, whose one side is narrow (576 out of wkv_a, 512 into wkv_b),
that traffic and the cast kernels can cost more than FP8 saves on the matmul.

`install` rebinds `TransformerEngineQuantization.dot_general_cls`, which MaxText's `DenseGeneral` calls with
its kernel's logical axes, so that the kernels of the chosen projections get XLA's BF16 dot inside TE's own
wrapper module: the module tree, the parameters and their names stay as they are, and checkpoints are alike
either way. The MTP layer's attention has the same axes and follows the decoder's choice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

# The recipe's names (DeepSeek-V3's and MaxText's parameter names) -> the logical axes of MaxText's kernels.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "wq_a": ("embed_attn", "q_lora_up_proj"),
    "wq_b": ("q_lora", "q_heads", "kv"),
    "wkv_a": ("embed_attn", "kv_lora_up_proj"),
    "wkv_b": ("kv_lora", "kv_heads", "kv_head_dim"),
}

_chosen: frozenset[tuple[str, ...]] = frozenset()


def install(names: Iterable[str]) -> None:
    """Make the TE-quantized models MaxText builds from now on in this process compute the named projections
    in BF16 (none: all in FP8, as MaxText builds them)."""
    global _chosen
    _chosen = frozenset(PROJECTIONS[n] for n in names)
    if not _chosen:
        return
    from maxtext.layers import quantizations

    cls = quantizations.TransformerEngineQuantization
    if getattr(cls.dot_general_cls, "keeps_bf16_projections", False):
        return
    te_dot_general_cls = cls.dot_general_cls

    def dot_general_cls(self: Any, mesh_axes: tuple[str, ...] = ()) -> Any:
        if tuple(mesh_axes) not in _chosen:
            return te_dot_general_cls(self, mesh_axes)
        return self._wrap(_bf16_dot_general, "dot_general")

    dot_general_cls.keeps_bf16_projections = True  # type: ignore[attr-defined]
    cls.dot_general_cls = dot_general_cls
    log.info("attention: %s in BF16", ", ".join(sorted(n for n, a in PROJECTIONS.items() if a in _chosen)))


def _bf16_dot_general(
    generate_quantizer_set: Any, generate_collective_op_set: Any, x: Any, kernel: Any, dims: Any, **kwargs: Any
) -> Any:
    """The GEMM as XLA computes it with no quantization: the kernel in the activations' dtype."""
    import jax

    return jax.lax.dot_general(x, kernel.astype(x.dtype), dims)
