"""Checks of the recipe's `moe:` section against MaxText keys and the topology (`validate.resolve` calls
`settings`): what our block (`moe.impl: ours`) and its exchanges cannot run with.

Why here: these checks need MaxText's keys, which `moe/settings.py` (the section alone, no MaxText) does
not read; they are kept apart from `validate.py`, which checks the rest of a recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from maxtext_moe.errors import UserError
from maxtext_moe.moe.settings import SEQ_BALANCE, MoeSettings, Sourced
from maxtext_moe.recipe.resolved import Topology


class Checker(Protocol):
    """What these checks use of `validate._Checker`: a MaxText key's value, and a failure naming its file."""

    maxtext: dict[str, Any]  # the MaxText keys the recipe sets

    def value(self, key: str) -> Any: ...

    def fail(self, key: str, message: str, fix: str) -> None: ...


def settings(section: Mapping[str, Sourced], check: Checker, topo: Topology) -> MoeSettings:
    """The `moe` section with defaults (`MoeSettings`), and the checks of it against MaxText keys."""
    settings = MoeSettings.from_section(section, topo.profile)
    if settings.seq_balance_loss_weight > 0:
        _sequence_balance(f"{settings.seq_balance_loss_weight} ({section[SEQ_BALANCE].source})", check)
    if not settings.ours:
        return settings
    if check.value("decoder_block") != "deepseek":
        check.fail(
            "decoder_block",
            f"is {check.value('decoder_block')!r}, but moe.impl: ours replaces the routed "
            "experts of MaxText's DeepSeek decoder layer only.",
            "use a DeepSeek model (decoder_block: deepseek), or remove moe.impl.",
        )
    if check.value("num_experts") <= 1:
        check.fail(
            "num_experts",
            "is 1: moe.impl: ours replaces the routed-expert block, which this model lacks.",
            "remove moe.impl, or give the model experts.",
        )
    if check.value("te_moe_block"):
        check.fail(
            "te_moe_block",
            "is true, but moe.impl: ours replaces the routed-expert block with ours.",
            "choose one: set te_moe_block: false, or remove moe.impl.",
        )

    def split(axis: str) -> str | None:
        """The first of ici_/dcn_`axis`_parallelism that splits the mesh (-1 included), or None."""
        return next((k for net in ("ici", "dcn") if check.value(k := f"{net}_{axis}_parallelism") != 1), None)

    expert_parallel = split("expert") is not None
    # Our dispatch runs over the mesh axis `expert` (`deepseek_layer.py`); these MaxText EP variants use others.
    if expert_parallel and check.value("use_ring_of_experts"):
        check.fail(
            "use_ring_of_experts",
            "is true, but moe.impl: ours does its own expert-parallel dispatch "
            "(deduplicated ragged all-to-all), not MaxText's ring of experts.",
            "set use_ring_of_experts: false, or use moe.impl: maxtext.",
        )
    if expert_parallel and check.value("custom_mesh_and_rule") == "cp-as-ep":
        check.fail(
            "custom_mesh_and_rule",
            "is cp-as-ep, but moe.impl: ours dispatches over the expert axis alone.",
            "remove custom_mesh_and_rule, or use moe.impl: maxtext.",
        )
    if expert_parallel and split("pipeline"):
        check.fail(
            split("pipeline"),
            "is not 1, but moe.impl: ours does not run expert parallelism inside MaxText's pipeline stages.",
            "set it to 1, or use moe.impl: maxtext.",
        )
    if settings.dispatch_chunks > 1 and not expert_parallel:
        raise UserError(
            f"is {settings.dispatch_chunks}, but this recipe has no expert parallelism: the chunks split the "
            "expert-parallel exchange, and with one rank there is none to overlap.",
            key="moe.dispatch_chunks",
            source=section["dispatch_chunks"].source,
            fix="set moe.dispatch_chunks: 1, or ici_expert_parallelism to 2 or more.",
        )
    if settings.exchange == "nccl_ep":
        _nccl_ep(section, check, topo, expert_parallel, split)
    return settings


def _sequence_balance(weight: str, check: Checker) -> None:
    """What the sequence-wise balance loss cannot run beside, on either block: another balance loss of
    MaxText's on the same layers, and MaxText's step averaging the layers' losses where DeepSeek-V3 adds them
    (`maxtext_keys`). `weight`: its value and where it was set."""
    if check.value("load_balance_loss_weight") > 0:
        check.fail(
            "load_balance_loss_weight",
            f"is {check.value('load_balance_loss_weight')}, and moe.seq_balance_loss_weight is {weight}: each adds "
            "a balance loss to every MoE layer.",
            "keep one: set load_balance_loss_weight: 0 for DeepSeek-V3's sequence-wise loss, or "
            "moe.seq_balance_loss_weight: 0 for MaxText's.",
        )
    if check.value("moe_use_megatron_seq_aux_loss") is False and "moe_use_megatron_seq_aux_loss" in check.maxtext:
        check.fail(
            "moe_use_megatron_seq_aux_loss",
            f"is false, but moe.seq_balance_loss_weight is {weight}, and MaxText's step adds "
            "the MoE layers' losses, as DeepSeek-V3 does, only with it on (otherwise it averages them).",
            "remove moe_use_megatron_seq_aux_loss: maxtext-moe sets it.",
        )


def maxtext_keys(settings: MoeSettings) -> dict[str, Any]:
    """MaxText keys that carry out the `moe` section's sequence-wise balance loss. Each of our layers sows it as
    `moe_lb_loss`, which MaxText's `loss_fn` adds to the loss: summed over the MoE layers (decoder and MTP, as
    DeepSeek-V3 and Megatron-LM add each layer's) under `moe_use_megatron_seq_aux_loss`, averaged without; the
    key changes nothing else in our block. MaxText's own block computes the same loss itself under that key
    (`RoutedMoE.megatron_seq_aux_loss`: eq. 18's top-K of the unbiased affinities, P normalized per token,
    E^2 x mean(f P) = the paper's sum), weighted by its `load_balance_loss_weight`, so a model fragment's alpha
    trains either block, and comparisons between them run the same loss."""
    weight = settings.seq_balance_loss_weight
    if weight <= 0:
        return {}
    return {"moe_use_megatron_seq_aux_loss": True} | ({} if settings.ours else {"load_balance_loss_weight": weight})


def _nccl_ep(
    section: Mapping[str, Sourced],
    check: Checker,
    topo: Topology,
    expert_parallel: bool,
    split: Callable[[str], str | None],
) -> None:
    """What TE 2.20.2's NCCL EP (`moe/nccl_ep.py`) cannot run with, refused before anything starts."""
    where = section["exchange"].source

    def refuse(message: str, fix: str) -> None:
        raise UserError(f"is nccl_ep, but {message}", key="moe.exchange", source=where, fix=fix)

    if topo.num_devices < 2:
        refuse(
            "this recipe runs on one GPU and NCCL EP needs at least 2 ranks (TE's ep_bootstrap).",
            "use moe.exchange: auto on one GPU.",
        )
    if not expert_parallel:
        refuse(
            "ici_expert_parallelism is 1 and NCCL EP needs at least 2 expert-parallel ranks (TE's ep_bootstrap).",
            "set ici_expert_parallelism to 2 or more, or moe.exchange: auto.",
        )
    if split("data") and split("fsdp"):
        refuse(
            f"{split('data')} and {split('fsdp')} both split the mesh; NCCL EP takes one data-parallel axis "
            "outside the expert axis.",
            "keep one of them at 1, or use moe.exchange: auto.",
        )
    if str(check.value("dtype")) != "bfloat16":
        check.fail(
            "dtype",
            f"is {check.value('dtype')}, but moe.exchange: nccl_ep dispatches BF16 tokens only (TE 2.20.2).",
            "set dtype: bfloat16, or moe.exchange: auto.",
        )
    factor = check.value("ragged_buffer_factor")
    if 0 < factor < 1:
        check.fail(
            "ragged_buffer_factor",
            f"is {factor}, but moe.exchange: nccl_ep sizes its receive buffer with a factor of at least 1 "
            "(TE's get_moe_recv_capacity_per_rank).",
            "set ragged_buffer_factor to 1 or more, or -1 for the dropless worst case.",
        )
