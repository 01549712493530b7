"""The parameter tree MaxText builds for a resolved recipe, without materialising it.

MaxText's `to_maxtext.get_maxtext_model_info` does this too, but it also builds a device mesh for the model's
sharding and lives in a module that registers its own Orbax handler on import; the conversion needs only names,
shapes and dtypes. Same calls: `models.transformer_as_linen` and `maxtext_utils.get_abstract_param`, keys
joined as MaxText's conversion utilities join them (`param_key_parts_from_path`).
"""

from __future__ import annotations

from typing import Any

from maxtext_moe.recipe.resolved import ResolvedRecipe


def abstract(resolved: ResolvedRecipe) -> tuple[Any, dict[str, tuple[tuple[int, ...], Any]]]:
    """MaxText's config for `resolved`, and its parameters as `"params-decoder-..." -> (shape, dtype)`."""
    import flax.linen as nn
    import jax
    from maxtext.checkpoint_conversion.utils.utils import param_key_parts_from_path
    from maxtext.common.common_types import MODEL_MODE_TRAIN
    from maxtext.layers import quantizations
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    from maxtext_moe.upstream import maxtext_config, mtp_quant

    if resolved.moe_settings.ours:
        from maxtext_moe.upstream import deepseek_layer

        deepseek_layer.install(resolved.moe_settings)
    mtp_quant.install()
    config = maxtext_config.check(resolved.maxtext, resolved.sources)
    mesh = jax.sharding.Mesh(maxtext_utils.create_device_mesh(config), config.mesh_axes)
    model = models.transformer_as_linen(
        config, mesh, quant=quantizations.configure_quantization(config), model_mode=MODEL_MODE_TRAIN
    )
    tree = maxtext_utils.get_abstract_param(model, config)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    params = {}
    for path, leaf in flat:
        value = leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf
        params["-".join(param_key_parts_from_path(path))] = (tuple(value.shape), value.dtype)
    return config, params
