"""The recipe's device mesh against the cluster, the experts and the weights it shards, before jax starts.

MaxText builds its mesh from the `ici_*_parallelism` sizes only once jax runs, and learns that a weight
cannot be split the way its `logical_axis_rules` ask only when XLA compiles the step: DeepSeek-V3 on 1024
GPUs as FSDP 128 x EP 8 puts `kv_lora_rank` (512) of every MLA layer on `fsdp x ... x expert`, 1024
ways, and the compile stops after minutes of tracing with an IndivisibleError. These checks name the key
and the fix first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from maxtext_moe.recipe import maxtext_keys
from maxtext_moe.recipe.resolved import Topology

# Weight dimensions MaxText's rules shard across devices (the logical names of the DeepSeek decoder's
# weights that lie on fsdp-like axes), and the key holding each one's size.
WEIGHT_DIMS: dict[str, str] = {
    "kv_lora": "kv_lora_rank",
    "q_lora": "q_lora_rank",
    "embed": "emb_dim",
    "embed_attn": "emb_dim",
    "embed_vocab": "emb_dim",
    "embed_moe": "emb_dim",
    "embed_router": "emb_dim",
    "mlp": "mlp_dim",
    "mlp_moe": "moe_mlp_dim",
}
# MaxText's mesh axes whose ici_*_parallelism key is not ici_<axis>_parallelism.
AXIS_KEYS = {"stage": "ici_pipeline_parallelism"}

Value = Callable[[str], Any]
Fail = Callable[[str, str, str], None]


def _axis_keys(net: str) -> list[str]:
    """MaxText's `{net}_*_parallelism` keys (ici or dcn): the per-axis sizes, not its derived lists."""
    return [
        k
        for k, v in maxtext_keys.defaults().items()
        if k.startswith(f"{net}_") and k.endswith("_parallelism") and isinstance(v, int)
    ]


def check(value: Value, fail: Fail, topo: Topology) -> None:
    """The mesh fits the devices, expert parallelism divides the experts, and the sharded weights divide."""
    sizes = _fits(value, fail, topo)
    ep = sizes["ici_expert_parallelism"]
    if value("num_experts") % ep:
        fail(
            "ici_expert_parallelism",
            f"is {ep}, which does not divide num_experts={value('num_experts')}.",
            "choose an expert-parallel size that divides the number of experts.",
        )
    _weights(value, fail, sizes)


def _fits(value: Value, fail: Fail, topo: Topology) -> dict[str, int]:
    """Each ici_*_parallelism size, -1 filled in, after checking that their product is the device count."""
    axes = _axis_keys("ici")
    total = topo.num_devices
    known, fill = 1, []
    for key in axes:
        v = value(key)
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            fail(key, f"must be a positive integer or -1, got {v!r}.", "use -1 for 'the rest of the devices'.")
        if v == -1:
            fill.append(key)
        else:
            known *= v
    if len(fill) > 1:
        fail(fill[1], f"is -1 and so is {fill[0]}; only one axis may be -1.", "give the others sizes.")
    shown = " x ".join(f"{k}={value(k)}" for k in axes if value(k) != 1) or "all 1"
    if (fill and total % known) or (not fill and known != total):
        key = fill[0] if fill else next((k for k in axes if value(k) != 1), "ici_fsdp_parallelism")
        fail(
            key,
            f"the mesh ({shown}) does not fit {total} devices ({topo.nodes} node(s) x {topo.gpus_per_node}).",
            "make the product of the ici_*_parallelism sizes equal the device count, or set one to -1.",
        )
    for key in _axis_keys("dcn"):
        if value(key) not in (1, -1):
            fail(
                key,
                "is not 1, but on GPUs and CPUs MaxText sees all devices as one slice.",
                "put the size in the matching ici_*_parallelism key instead.",
            )
    return {k: total // known if value(k) == -1 else value(k) for k in axes}


def _weights(value: Value, fail: Fail, sizes: dict[str, int]) -> None:
    """Every weight dimension in `WEIGHT_DIMS` divides by the mesh axes its first logical-axis rule names
    (the rule flax applies when no other dimension of the weight already holds those axes)."""
    rules: dict[str, list[str]] = {}
    for name, axes in value("logical_axis_rules") or []:
        rules.setdefault(name, [axes] if isinstance(axes, str) else list(axes))
    for name, size_key in WEIGHT_DIMS.items():
        dim = value(size_key)
        if name not in rules or not isinstance(dim, int) or dim <= 0:
            continue
        split = {a: sizes.get(AXIS_KEYS.get(a, f"ici_{a}_parallelism"), 1) for a in rules[name]}
        ways = math.prod(split.values())
        if dim % ways:
            over = {a: n for a, n in split.items() if n > 1}
            widest = max(over, key=over.get)
            key = AXIS_KEYS.get(widest, f"ici_{widest}_parallelism")
            fail(
                key,
                f"splits the weights' {name} dimension ({size_key}={dim}) "
                f"{' x '.join(f'{a} {n}' for a, n in over.items())} = {ways} ways, which does not divide it "
                "(MaxText's logical_axis_rules shard it over those mesh axes; XLA refuses it when compiling).",
                "move a factor to data parallelism (ici_data_parallelism, which replicates the weights), "
                f"so that the product divides {dim}.",
            )
