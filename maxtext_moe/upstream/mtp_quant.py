"""Quantize the MTP layer's GEMMs as the decoder's (`quantization:`), so FP8 recipes train it in FP8.

The gap: MaxText 0.2.5's `Transformer` builds `MultiTokenPredictionBlock` without its `quant`, and
`MultiTokenPredictionLayer` builds its projection of the two normalised streams (a `DenseGeneral`) and its
transformer layer without one. So under `quantization: te_fp8_currentscaling` each GEMM of the MTP layer but its
routed experts (which `moe.fp8` quantizes in our layer) ran in BF16: in the FP8 proxy's compiled step on an H200,
66 of the 158 TFLOP a step of GEMMs left to XLA. DeepSeek-V3 computes the MTP module's GEMMs in FP8 like the rest
of the model (its report keeps the embedding, the output head, the gating, the norms and attention in higher
precision); the shared output head stays MaxText's BF16 one here too.

`install` rebinds `maxtext.models.models.MultiTokenPredictionBlock`, the name `Transformer` builds the block
with, to a subclass that builds MaxText's own layers with the decoder's `quant`: the transformer layer through
its `quant` argument, the projection through `DenseGeneral`'s, the latter by rebinding
`multi_token_prediction.DenseGeneral` while the block is built (MaxText's constructor names it there). With no
quantization the decoder's `quant` is None and the layers are built as MaxText builds them. The parameters keep
their names and shapes: TE's and AQT's dot-general wrappers hold no parameters of their own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WithQuant:
    """A layer class with `quant` bound: what MaxText's MTP layer calls as its `transformer_layer_module`.
    Compares by value, as the layer class it replaces does, since Flax keeps it as a static attribute."""

    layer: type
    quant: Any

    def __call__(self, **kwargs: Any) -> Any:
        return self.layer(quant=self.quant, **kwargs)


@contextlib.contextmanager
def _projection_quantized(quant: Any) -> Iterator[None]:
    from maxtext.layers import multi_token_prediction

    dense = multi_token_prediction.DenseGeneral
    multi_token_prediction.DenseGeneral = functools.partial(dense, quant=quant)
    try:
        yield
    finally:
        multi_token_prediction.DenseGeneral = dense


@functools.cache
def quantized_block() -> type:
    """The block's subclass, one per process, so that `install` can tell it is in place."""
    from maxtext.layers.multi_token_prediction import MultiTokenPredictionBlock

    class QuantizedMultiTokenPredictionBlock(MultiTokenPredictionBlock):
        """MaxText's MTP block, its layers built with the decoder's quantization."""

        def __init__(self, config: Any, mesh: Any, transformer_layer_module: type, decoder: Any, rngs: Any):
            quant = decoder.quant
            if quant is None:
                super().__init__(config, mesh, transformer_layer_module, decoder, rngs)
                return
            with _projection_quantized(quant):
                super().__init__(config, mesh, WithQuant(transformer_layer_module, quant), decoder, rngs)

    return QuantizedMultiTokenPredictionBlock


def install() -> None:
    """Make the models MaxText builds from now on in this process quantize their MTP layers as their decoder
    layers (`Transformer` looks the block's class up in `maxtext.models.models` when it builds)."""
    from maxtext.models import models

    block = quantized_block()
    if models.MultiTokenPredictionBlock is block:
        return
    models.MultiTokenPredictionBlock = block
    log.info("MTP: the MTP layer's GEMMs take the decoder's quantization")
