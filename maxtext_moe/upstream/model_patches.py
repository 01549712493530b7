"""The patches that shape the model MaxText builds and the program XLA compiles from it, installed alike by a run
(`run/train.py`) and by `plan --compile` (`upstream/aot.py`), so that the compile is of the step the run takes.

Install before MaxText builds the model: each takes effect for the models built after it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def install(attention: Mapping[str, Any]) -> None:
    """The recipe's `attention` section picks the remat of attention's residuals, its kernel and the MLA
    projections kept in BF16; the rest hold for every recipe."""
    from maxtext_moe.upstream import bf16_projections, mtp_quant, placeholder_constants, remat, remat_cse

    remat.install(attention_residuals=attention.get("residuals") == "save")
    if attention.get("kernel") == "fa3":
        from maxtext_moe.upstream import fa3_attention

        fa3_attention.install()
    remat_cse.install()  # full remat stays full under gradient accumulation
    mtp_quant.install()
    bf16_projections.install(attention.get("bf16_projections", []))
    placeholder_constants.install()  # XLA merges TE's casts of one tensor
