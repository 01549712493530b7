"""`moe.exchange: nccl_ep` (TE's NCCL EP around our block): what the recipe checks refuse before anything runs,
on the real recipe files and through the CLI; no jax, no TE."""

from __future__ import annotations

import pytest
from conftest import run_cli

from maxtext_moe.errors import UserError
from maxtext_moe.recipe import composition
from maxtext_moe.recipe.validate import resolve

TWO = "deepseek3-proxy-h200-2gpu"
NCCL_EP = "moe.exchange=nccl_ep"


def error_of(ref: str, *overrides: str) -> str:
    with pytest.raises(UserError) as e:
        resolve(composition.compose(ref, list(overrides)))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_two_gpu_proxy_takes_nccl_ep_and_keeps_its_default_exchange() -> None:
    assert resolve(composition.compose(TWO, [])).moe["exchange"] == "auto"
    r = resolve(composition.compose(TWO, [NCCL_EP]))
    assert r.moe["exchange"] == "nccl_ep" and r.sources["moe.exchange"] == "command line"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ("deepseek3-tiny-cpu", "moe.impl=ours", "topology.gpus_per_node=2", "ici_expert_parallelism=2", NCCL_EP),
            "moe.exchange: is nccl_ep, which NCCL (through TE) runs on GPUs only, and this recipe runs on cpu. "
            "Fix: use moe.exchange: auto",
        ),
        (
            ("deepseek3-proxy-h200-1gpu", NCCL_EP),
            "moe.exchange: is nccl_ep, but this recipe runs on one GPU and NCCL EP needs at least 2 ranks "
            "(TE's ep_bootstrap). Fix: use moe.exchange: auto on one GPU.",
        ),
        (
            (TWO, NCCL_EP, "ici_expert_parallelism=1", "ici_fsdp_parallelism=2"),
            "moe.exchange: is nccl_ep, but ici_expert_parallelism is 1 and NCCL EP needs at least 2 "
            "expert-parallel ranks",
        ),
        (
            ("deepseek3-tiny-cpu", NCCL_EP),
            "moe.exchange: is nccl_ep, which runs our block's routing around TE's NCCL EP; MaxText's own block "
            "reaches NCCL EP only as TE's fused MoE (te_moe_block). Fix: set moe.impl: ours",
        ),
        (
            (TWO, NCCL_EP, "moe.fp8=current_scaling"),
            "moe.fp8: is current_scaling with moe.exchange: nccl_ep, but TE 2.20.2's NCCL EP dispatches BF16 "
            "tokens only",
        ),
        (
            (TWO, NCCL_EP, "dtype=float32"),
            "dtype: is float32, but moe.exchange: nccl_ep dispatches BF16 tokens only (TE 2.20.2). "
            "Fix: set dtype: bfloat16, or moe.exchange: auto.",
        ),
        (
            (TWO, NCCL_EP, "ragged_buffer_factor=0.5"),
            "ragged_buffer_factor: is 0.5, but moe.exchange: nccl_ep sizes its receive buffer with a factor of "
            "at least 1",
        ),
        (
            (TWO, NCCL_EP, "topology.gpus_per_node=8", "ici_expert_parallelism=2", "ici_data_parallelism=2")
            + ("ici_fsdp_parallelism=2",),
            "moe.exchange: is nccl_ep, but ici_data_parallelism and ici_fsdp_parallelism both split the mesh",
        ),
    ],
    ids=["cpu", "one-gpu", "ep1", "maxtext-block", "fp8", "fp32-tokens", "buffer-below-1", "data-and-fsdp"],
)
def test_nccl_ep_refusals_name_the_key_and_the_fix(overrides: tuple[str, ...], expected: str) -> None:
    assert expected in error_of(*overrides)


def test_cli_refuses_nccl_ep_on_one_gpu_in_one_line() -> None:
    r = run_cli("show", "deepseek3-proxy-h200-1gpu", NCCL_EP, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip()
    assert "\n" not in line and "moe.exchange: is nccl_ep" in line and "Fix: use moe.exchange: auto" in line
