"""JAX's coordination service client (JAX 0.11.2), which `jax.distributed` starts but does not expose.

The gap: processes of one run must agree on who prepares the run folder and the corpus, and a failure
on process 0 must reach the others as its message rather than as a barrier timeout. JAX's key-value
store does that, and the only handle to it is `jax._src.distributed.global_state.client`.
"""

from __future__ import annotations

from typing import Any


def client() -> Any:
    """The key-value client of the running `jax.distributed` runtime (`key_value_set`,
    `blocking_key_value_get`)."""
    from jax._src import distributed

    return distributed.global_state.client
