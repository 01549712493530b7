"""Runs in the product's venv: the logits of MaxText's model (the recipe's config, our block where the recipe
says `moe.impl: ours`) with the parameters of an Orbax folder written by `convert hf-to-orbax`, or of a training
run's checkpoint step (whose NNX state keeps the `MoEBiasVar` collection under `nnx_aux`).

    python maxtext_logits.py CHECKPOINT RECIPE --tokens 1,2,3 --logits L.npy [key=value ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint", type=Path)
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--tokens", required=True)
    p.add_argument("--logits", required=True, type=Path)
    a = p.parse_args()

    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    from maxtext_moe.cli import resolve
    from maxtext_moe.upstream import maxtext_params

    config, _ = maxtext_params.abstract(resolve(a.recipe, a.overrides))  # installs our block if the recipe says
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(
        config, mesh, quant=quantizations.configure_quantization(config), model_mode=MODEL_MODE_TRAIN
    )
    restored = ocp.PyTreeCheckpointer().restore(a.checkpoint.resolve() / "items")
    params = restored["params"]
    if "nnx_aux" in restored:
        params = params | {"MoEBiasVar": restored["nnx_aux"]["model"]}
    tokens = jnp.asarray([[int(t) for t in a.tokens.split(",")]], dtype=jnp.int32)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    with mesh:
        logits = model.apply(params, tokens, positions, enable_dropout=False, model_mode=MODEL_MODE_TRAIN)
    if isinstance(logits, tuple):
        logits = logits[0]
    np.save(a.logits, np.asarray(logits[0], dtype=np.float32))


if __name__ == "__main__":
    main()
