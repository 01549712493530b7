"""Names of the MoE block's stages in the compiled program, so a profile can say where its time went.

XLA keeps a JAX named scope in each HLO op's `op_name`; MaxText's model sets none, so without these a
profile cannot tell the block's routing and row shuffles from the rest of the step (`tools/profile.py`
reads them back through the compiled HLO). They change no computation.
"""

from __future__ import annotations

ROUTING = "moe_routing"  # gate, top-k, the sort by expert or the per-rank dispatch plan
PERMUTE = "moe_permute"  # copies of rows into expert order (and their expansion after an exchange)
EXPERTS = "moe_experts"  # the grouped GEMMs and the activation between them
UNPERMUTE = "moe_unpermute"  # rows back to token order and the weighted sum over the top-k
EXCHANGE = "moe_exchange"  # expert-parallel sends and returns

ALL = (ROUTING, PERMUTE, EXPERTS, UNPERMUTE, EXCHANGE)
