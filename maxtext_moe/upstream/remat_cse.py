"""Keep full remat under gradient accumulation on GPUs: the recomputed forward stays apart from the forward.

The gap: MaxText 0.2.5 checkpoints each unrolled decoder layer with `jax.checkpoint(prevent_cse=...)` and
takes the flag from `maxtext_utils.should_prevent_cse_in_remat`, which answers False for scanned layers and
also whenever `gradient_accumulation_steps > 1` on GPUs. For scanned layers that is right: the layer scan's
forward and backward are two loops, and XLA cannot merge a recomputation with a forward in another loop.
Under gradient accumulation it is not: the accumulation scan takes the whole gradient inside its body, so the
forward and the backward of every unrolled layer share one loop body. Without the optimization barrier that
`prevent_cse` puts on each recomputation's inputs, XLA's common-subexpression elimination merges the
backward's recomputation of each layer with its forward, and every layer's activations are kept from the
forward to the backward, as if no remat had been asked for.

Seen on five layers of `deepseek3-671b-h200-128` compiled deviceless for 128 H200s (XLA's dump,
`python -m maxtext_moe.plan.peak`): accumulated twice or 20 times, the step's peak (82.4 GiB against 46.7 for
one step) holds all five layers' recomputed attention and expert buffers, made during the forward; the
program before XLA's passes has the five `remat2` optimization barriers of one step missing. This answers
as MaxText does everywhere except that one case: unrolled layers keep their barrier under accumulation.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

log = logging.getLogger(__name__)


def prevent_cse(config: Any) -> bool:
    """Whether a checkpointed decoder layer keeps its recomputation apart from its forward: always, unless the
    layers are scanned (MaxText's own answer for them)."""
    return not config.scan_layers


def install() -> None:
    """Make MaxText's decoders built from now on in this process keep the remat barrier of unrolled layers
    under gradient accumulation (MaxText's decoders look the function up in `maxtext_utils` when they build)."""
    from maxtext.utils import maxtext_utils

    original = maxtext_utils.should_prevent_cse_in_remat
    if getattr(original, "keeps_barrier_under_accumulation", False):
        return

    @functools.wraps(original)
    def should_prevent_cse_in_remat(config: Any) -> bool:
        return prevent_cse(config)

    should_prevent_cse_in_remat.keeps_barrier_under_accumulation = True  # type: ignore[attr-defined]
    maxtext_utils.should_prevent_cse_in_remat = should_prevent_cse_in_remat
    log.info("remat: unrolled layers keep their recomputation apart from the forward under gradient accumulation")
