"""The MTP layer quantized as the decoder's layers (maxtext_moe/upstream/mtp_quant.py), on the CPU: MaxText's AQT
int8 quantization stands in for TE's FP8 (which needs a GPU), since both reach the layers through the same
`quant`. Unscanned layers, so each layer's GEMMs appear once in the lowered step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from maxtext_moe.cli import resolve
from maxtext_moe.upstream import maxtext_params, mtp_quant

TINY = ["scan_layers=false"]  # 1 dense + 3 MoE layers, one MTP layer
INT8 = [*TINY, "quantization=int8"]
INT8_DOT = re.compile(r"stablehlo\.dot_general[^\n]*tensor<[^>]*xi8>")


def _lowered(overrides: list[str], monkeypatch: pytest.MonkeyPatch, block: type | None = None) -> tuple[str, list]:
    """The tiny model's forward with its MTP loss, lowered: its text and its variables' shapes. MaxText builds it
    as `maxtext_params` has set it up (the MTP layer quantized), or with `block` as the MTP block."""
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    config, _ = maxtext_params.abstract(resolve("deepseek3-tiny-cpu", overrides))
    assert models.MultiTokenPredictionBlock is mtp_quant.quantized_block()
    if block is not None:
        monkeypatch.setattr(models, "MultiTokenPredictionBlock", block)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(
        config, mesh, quant=quantizations.configure_quantization(config), model_mode=MODEL_MODE_TRAIN
    )
    tokens = jnp.ones((1, 16), jnp.int32)
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    kw = dict(decoder_target_tokens=tokens, decoder_target_mask=tokens, enable_dropout=False)
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1), "aqt": jax.random.key(2)}
    with jax.set_mesh(mesh):
        variables = jax.eval_shape(lambda: model.init(keys, tokens, positions, **kw))
        step = jax.jit(lambda v: model.apply(v, tokens, positions, rngs={"aqt": keys["aqt"]}, mutable=True, **kw))
        text = step.lower(variables).as_text()
    return text, jax.tree_util.tree_leaves_with_path(variables["params"])


@pytest.fixture
def maxtexts_block(monkeypatch: pytest.MonkeyPatch) -> type:
    """MaxText's own MTP block, put back after the test."""
    from maxtext.models import models

    monkeypatch.setattr(models, "MultiTokenPredictionBlock", models.MultiTokenPredictionBlock)
    from maxtext.layers.multi_token_prediction import MultiTokenPredictionBlock

    return MultiTokenPredictionBlock


def test_the_mtp_layer_takes_the_quantization_of_a_decoder_layer_and_keeps_its_parameters(
    maxtexts_block: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    one_more_layer, _ = _lowered([*INT8, "mtp_num_layers=0", "base_num_decoder_layers=5"], monkeypatch)
    ours, our_params = _lowered(INT8, monkeypatch)
    maxtexts, maxtexts_params = _lowered(INT8, monkeypatch, maxtexts_block)

    quantized = len(INT8_DOT.findall(ours))
    # A fifth decoder layer's quantized GEMMs, plus the MTP layer's projection of its two streams.
    assert quantized == len(INT8_DOT.findall(one_more_layer)) + 1
    # MaxText's own build quantizes none of the MTP layer's GEMMs: as many as the four decoder layers'.
    assert len(INT8_DOT.findall(maxtexts)) == quantized - 10
    assert ours.count("dot_general") == maxtexts.count("dot_general")
    shapes = [(jax.tree_util.keystr(p), v.shape, v.dtype) for p, v in our_params]
    assert shapes == [(jax.tree_util.keystr(p), v.shape, v.dtype) for p, v in maxtexts_params]
    assert any("mtp_1_projection" in name for name, _, _ in shapes)


def test_without_quantization_the_model_is_maxtexts(maxtexts_block: type, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, _ = _lowered(TINY, monkeypatch)
    maxtexts, _ = _lowered(TINY, monkeypatch, maxtexts_block)
    assert INT8_DOT.search(ours) is None
    assert ours == maxtexts
