"""Where each Hugging Face tensor lands in the MaxText parameter tree: MaxText's DeepSeek mapping, completed.

MaxText's `DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING` and `..._HOOK_FN` (checkpoint_conversion/utils/param_mapping.py)
give the names, the stacking (layers, experts) and the transposes; they are used as they are. They leave out:

- the MTP layer (`mtp_block-mtp_layer_K-...`), stored by DeepSeek as decoder layer `num_hidden_layers + K - 1`
  with `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` beside an ordinary MoE layer's tensors;
- the router's `e_score_correction_bias` where the recipe updates it (aux-loss-free balancing): MaxText keeps
  it in the `MoEBiasVar` collection, not under `params-`, where the mapping puts it;
- the order in which one array's slices arrive: each `Target` lists its slices so they can be written one at
  a time (MaxText's converter stacks the whole array in memory first);
- MaxText's `prefuse_moe_weights` tree, whose one routed-expert `wi` holds DeepSeek's `gate_proj` in the first
  half of its last axis and `up_proj` in the second (MaxText's mapping names wi_0 and wi_1 only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from maxtext_moe.moe.layer import FUSED_UP

MOE_BIAS = "MoEBiasVar-"
# Where MaxText's NNX training state saves non-parameter collections such as `MoEBiasVar`.
NNX_AUX = "nnx_aux.model."


@dataclass(frozen=True)
class Slice:
    index: tuple[int | slice, ...]  # where the block goes in the MaxText array
    hf_key: str
    shape: tuple[int, ...]  # the block's shape: the array's, less the stacked axes


@dataclass(frozen=True)
class Target:
    """One MaxText array: its key, shape and dtype, the slices its Hugging Face tensors fill, and the hook
    (MaxText's) that turns one Hugging Face tensor into one block."""

    key: str
    shape: tuple[int, ...]
    dtype: Any
    slices: tuple[Slice, ...]
    hook: Any

    @property
    def chunk(self) -> tuple[int, ...]:
        """One slice's extent in the array: 1 on a stacked axis, a part of a split axis, else the whole axis."""
        return tuple(
            1 if isinstance(i, int) else len(range(*i.indices(n)))
            for i, n in zip(self.slices[0].index, self.shape, strict=True)
        )


def _mtp(hf_config: dict, mt_config: Any, layers: int, to_hf: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Mapping and hooks of the MTP layers: an unscanned MoE layer's, moved to `mtp_block`, plus the MTP
    norms and projection."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    mapping = param_mapping.DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING(hf_config, mt_config, scan_layers=False)
    hooks = param_mapping.DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN(
        hf_config, mt_config, scan_layers=False, saving_to_hf=to_hf
    )
    first_moe = f"model.layers.{hf_config['first_k_dense_replace']}."
    out_map: dict[str, Any] = {}
    out_hooks: dict[str, Any] = {}
    for k in range(1, layers + 1):
        hf = f"model.layers.{hf_config['num_hidden_layers'] + k - 1}."
        mt = f"params-mtp_block-mtp_layer_{k}-mtp_{k}_"

        def moved(v: Any, hf: str = hf) -> Any:
            return [moved(x) for x in v] if isinstance(v, list) else v.replace(first_moe, hf, 1)

        for key, value in mapping.items():
            if key.startswith("params-decoder-moe_layers_0-"):
                suffix = key.removeprefix("params-decoder-moe_layers_0-")
                out_map[f"{mt}transformer_layer-{suffix}"] = moved(value)
                if key in hooks:
                    out_hooks[f"{mt}transformer_layer-{suffix}"] = hooks[key]
        out_map |= {
            f"{mt}embedding_norm-scale": f"{hf}enorm.weight",
            f"{mt}hidden_state_norm-scale": f"{hf}hnorm.weight",
            f"{mt}final_norm-scale": f"{hf}shared_head.norm.weight",
            f"{mt}projection-kernel": f"{hf}eh_proj.weight",
        }
        out_hooks[f"{mt}projection-kernel"] = hooks["params-decoder-logits_dense-kernel"]  # transpose
    return out_map, out_hooks


def _stack_axes(key: str, sources: Any, shape: tuple[int, ...], mt_config: Any) -> tuple[int, ...]:
    """MaxText's stacking rule (to_maxtext's `_build_*_axis_stacked_tensor`): experts x layers lead; a scanned
    stack of layers sits at `param_scan_axis`, except the 1-D-per-layer bias, stacked first."""
    from maxtext.checkpoint_conversion.utils.tensor_handling import nesting_depth, stacked_axes

    depth = nesting_depth(sources)
    if depth != 1:
        return stacked_axes(key, mt_config, depth)
    scanned = mt_config.scan_layers and key.split("-")[2] in ("dense_layers", "moe_layers")
    if scanned and not key.startswith(MOE_BIAS) and len(shape) > mt_config.param_scan_axis:
        return (mt_config.param_scan_axis,)
    return (0,)


def _slices(sources: Any, axes: tuple[int, ...], shape: tuple[int, ...]) -> tuple[Slice, ...]:
    block = tuple(n for i, n in enumerate(shape) if i not in axes)

    def walk(node: Any, position: tuple[int, ...]) -> list[Slice]:
        if isinstance(node, str):
            where = dict(zip(axes, position, strict=True))
            index = tuple(where.get(i, slice(None)) for i in range(len(shape)))
            return [Slice(index, node, block)]
        return [s for i, child in enumerate(node) for s in walk(child, (*position, i))]

    return tuple(walk(sources, ()))


def _fused_up(key: str, shape: tuple[int, ...], dtype: Any, mapping: dict, hooks: dict, mt_config: Any) -> Target:
    """The `prefuse_moe_weights` array `...-MoeBlock_0-wi` [..., D, 2F] from MaxText's mapping of wi_0 (its first
    half of the last axis) and wi_1 (the second), each Hugging Face tensor hooked as MaxText hooks wi_0 and wi_1."""
    half = shape[-1] // 2
    gate, up = mapping[f"{key}_0"], mapping[f"{key}_1"]
    axes = _stack_axes(f"{key}_0", gate, shape, mt_config)
    slices = [
        Slice((*s.index[:-1], part), s.hf_key, s.shape)
        for sources, part in ((gate, slice(0, half)), (up, slice(half, shape[-1])))
        for s in _slices(sources, axes, (*shape[:-1], half))
    ]
    return Target(key, shape, dtype, tuple(slices), hooks.get(f"{key}_0"))


def targets(
    hf_config: dict, mt_config: Any, params: dict[str, tuple[tuple[int, ...], Any]], to_hf: bool = False
) -> list[Target]:
    """Every MaxText array of `params` with the Hugging Face tensors it is made of, in MaxText's order; the
    hooks turn a Hugging Face tensor into a MaxText block, or with `to_hf` a block into a Hugging Face tensor."""
    from maxtext.checkpoint_conversion.utils import param_mapping

    scan = bool(mt_config.scan_layers)
    mapping = param_mapping.DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING(hf_config, mt_config, scan_layers=scan)
    hooks = param_mapping.DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN(
        hf_config, mt_config, scan_layers=scan, saving_to_hf=to_hf
    )
    mtp_map, mtp_hooks = _mtp(hf_config, mt_config, int(mt_config.mtp_num_layers), to_hf)
    mapping, hooks = mapping | mtp_map, hooks | mtp_hooks
    for key in [k for k in mapping if k.endswith("-gate-bias")]:
        moved = MOE_BIAS + key.removeprefix("params-")
        if key not in params and moved in params:
            mapping[moved] = mapping.pop(key)
    fused = {k for k in params if k.endswith(f"-MoeBlock_0-{FUSED_UP}") and f"{k}_0" in mapping}
    unmapped = sorted(set(params) - set(mapping) - fused)
    if unmapped:
        raise ValueError(f"no Hugging Face source for MaxText parameters {unmapped}")
    out = []
    for key, (shape, dtype) in params.items():
        if key in fused:
            out.append(_fused_up(key, shape, dtype, mapping, hooks, mt_config))
            continue
        axes = () if isinstance(mapping[key], str) else _stack_axes(key, mapping[key], shape, mt_config)
        out.append(Target(key, shape, dtype, _slices(mapping[key], axes, shape), hooks.get(key)))
    return out


def hf_shapes(hf_config: dict, mtp_layers: int) -> dict[str, tuple[int, ...]]:
    """Each Hugging Face tensor's shape: MaxText's `DEEPSEEK_HF_WEIGHTS_TO_SHAPE`, plus the MTP layers (a MoE
    layer's tensors, the MTP norms and projection)."""
    from maxtext.checkpoint_conversion.utils.hf_shape import DEEPSEEK_HF_WEIGHTS_TO_SHAPE

    shapes = {k: tuple(v) for k, v in DEEPSEEK_HF_WEIGHTS_TO_SHAPE(hf_config).items()}
    h, first_moe = hf_config["hidden_size"], f"model.layers.{hf_config['first_k_dense_replace']}."
    for k in range(mtp_layers):
        mtp = f"model.layers.{hf_config['num_hidden_layers'] + k}."
        shapes |= {mtp + key.removeprefix(first_moe): v for key, v in shapes.items() if key.startswith(first_moe)}
        shapes |= {f"{mtp}{n}.weight": (h,) for n in ("enorm", "hnorm", "shared_head.norm")}
        shapes[f"{mtp}eh_proj.weight"] = (h, 2 * h)
    return shapes


def mtp_copies(hf_config: dict, mtp_layers: int) -> dict[str, list[str]]:
    """Tensors DeepSeek's checkpoints repeat in each MTP layer (its embedding and output head), which MaxText
    shares with the main model: Hugging Face key -> the MTP keys that repeat it."""
    layers = [f"model.layers.{hf_config['num_hidden_layers'] + k}." for k in range(mtp_layers)]
    return {
        "model.embed_tokens.weight": [f"{m}embed_tokens.weight" for m in layers],
        "lm_head.weight": [f"{m}shared_head.head.weight" for m in layers],
    }


def orbax_names(key: str) -> list[str]:
    """The Orbax names array `key` has: `params.` + its path in a converted folder; a training run's checkpoint
    keeps the `MoEBiasVar` collection under `nnx_aux.model.` instead."""
    names = ["params." + key.replace("-", ".")]
    if key.startswith(MOE_BIAS):
        names.append(NNX_AUX + key.removeprefix(MOE_BIAS).replace("-", "."))
    return names
