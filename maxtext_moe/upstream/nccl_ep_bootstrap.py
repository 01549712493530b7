"""Bootstrap NCCL EP for our block (`moe.exchange: nccl_ep`) where MaxText bootstraps it for its TE block.

The gap: NCCL EP must start once per process after `jax.distributed` and the mesh exist, and before the
model is first traced (`moe/nccl_ep.py`). MaxText 0.2.5 has exactly that place,
`max_utils.maybe_bootstrap_te_moe(config, mesh, shaped_batch)`, which `train_utils.setup_train_loop` calls
just before it builds the training state, inside the TE `global_shard_guard` of GPU training (its
`MeshResource` puts `ep_resource` on the `expert` axis); but it acts only for `te_moe_block`, which our
block replaces. `install` rebinds that one function: with our nccl_ep it bootstraps our layers, sized as
MaxText sizes its own (the largest per-call batch: the loaded micro-batch, the training and the evaluation
batch); otherwise it calls MaxText's.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from jax.sharding import Mesh
from maxtext.utils import max_utils

from maxtext_moe.moe import nccl_ep

log = logging.getLogger(__name__)


def tokens_per_rank(config: Any, mesh: Mesh, shaped_batch: dict[str, Any]) -> int:
    """Most tokens one rank hands NCCL EP in one model call: the largest per-call batch (as
    `maybe_bootstrap_te_moe` takes it) times the sequence, over the ranks that split the tokens."""
    loaded, seq = shaped_batch["inputs"].shape[:2]
    batch = max(loaded // config.gradient_accumulation_steps, config.micro_batch_size_to_train_on)
    if config.eval_interval > 0:
        batch = max(batch, config.micro_batch_size_to_eval_on)
    return -(-batch * seq // nccl_ep.groups(mesh))


def install() -> None:
    """Make MaxText's start-up bootstrap NCCL EP for our layers from now on in this process."""
    original = max_utils.maybe_bootstrap_te_moe
    if getattr(original, "bootstraps_ours", False):
        return

    @functools.wraps(original)
    def maybe_bootstrap_te_moe(config: Any, mesh: Mesh, shaped_batch: dict[str, Any]) -> None:
        boot = nccl_ep.bootstrap(
            mesh,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            max_tokens_per_rank=tokens_per_rank(config, mesh, shaped_batch),
            hidden_dim=config.emb_dim,
            buffer_factor=config.ragged_buffer_factor,
        )
        log.info("moe.exchange=nccl_ep: NCCL EP bootstrapped: %s", boot)
        original(config, mesh, shaped_batch)  # does nothing unless te_moe_block, which recipe checks refuse

    maybe_bootstrap_te_moe.bootstraps_ours = True  # type: ignore[attr-defined]
    max_utils.maybe_bootstrap_te_moe = maybe_bootstrap_te_moe
