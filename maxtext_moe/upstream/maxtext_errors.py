"""Unwrap the error MaxText 0.2.5's TE context hides.

The gap: `maxtext.utils.max_utils.transformer_engine_context`, entered on GPUs whenever TE imports, wraps
the training loop in `try: ... yield / except Exception: yield`, so any error in the loop (an
out-of-memory, say) reaches the caller as contextlib's RuntimeError about a generator that yielded twice;
the real error is that RuntimeError's context.
"""

from __future__ import annotations

REYIELDED = "generator didn't stop after throw()"


def underlying(e: BaseException) -> BaseException:
    """The failure to report for `e`: the first error that is not the context manager's re-yield."""
    while isinstance(e, RuntimeError) and str(e) == REYIELDED and e.__context__ is not None:
        e = e.__context__
    return e
