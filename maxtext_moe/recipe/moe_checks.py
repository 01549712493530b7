"""Checks of the recipe's `moe:` section against MaxText keys and the topology (`validate.resolve` calls
`settings`): what our block (`moe.impl: ours`) and its exchanges cannot run with.

Why here: these checks need MaxText's keys, which `moe/settings.py` (the section alone, no MaxText) does
not read; they are kept apart from `validate.py`, which checks the rest of a recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from maxtext_moe.errors import UserError
from maxtext_moe.moe.settings import MoeSettings, Sourced
from maxtext_moe.recipe.resolved import Topology


class Checker(Protocol):
    """What these checks use of `validate._Checker`: a MaxText key's value, and a failure naming its file."""

    def value(self, key: str) -> Any: ...

    def fail(self, key: str, message: str, fix: str) -> None: ...


def settings(section: Mapping[str, Sourced], check: Checker, topo: Topology) -> MoeSettings:
    """The `moe` section with defaults (`MoeSettings`), and the checks of it against MaxText keys."""
    settings = MoeSettings.from_section(section, topo.profile)
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
    if expert_parallel and settings.gemm == "te" and check.value("scan_layers"):
        # XLA's compiler (JAX 0.11.2, TE 2.20.2) crashes in backend_compile_and_load on this combination,
        # with either exchange and any number of processes; unrolled layers compile.
        check.fail(
            "scan_layers",
            "is true, but with moe.gemm: te and expert parallelism XLA's compiler crashes "
            "(segmentation fault) on scanned decoder layers; unrolled layers train.",
            "set scan_layers: false, or moe.gemm: tokamax.",
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
