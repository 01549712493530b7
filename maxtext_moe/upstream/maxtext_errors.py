"""Unwrap the error MaxText 0.2.5's TE context hides, and recognise XLA's out-of-memory error under it.

The gap: `maxtext.utils.max_utils.transformer_engine_context`, entered on GPUs whenever TE imports, wraps
the training loop in `try: ... yield / except Exception: yield`, so any error in the loop (an
out-of-memory, say) reaches the caller as contextlib's RuntimeError about a generator that yielded twice;
the real error is that RuntimeError's context. XLA reports a device allocation that does not fit as an
XlaRuntimeError whose text starts `RESOURCE_EXHAUSTED: Out of memory while trying to allocate N`
(buffer assignment, after the compile) or `RESOURCE_EXHAUSTED: Failed to allocate request for N` (the
allocator, at run time); MaxText passes it on as it is.
"""

from __future__ import annotations

import re

REYIELDED = "generator didn't stop after throw()"
_OUT_OF_MEMORY = re.compile(
    r"Out of memory while trying to allocate [^\s.]+(\.\d+)?\s?\w*|RESOURCE_EXHAUSTED: Failed to allocate [^\n(]+"
)


def underlying(e: BaseException) -> BaseException:
    """The failure to report for `e`: the first error that is not the context manager's re-yield."""
    while isinstance(e, RuntimeError) and str(e) == REYIELDED and e.__context__ is not None:
        e = e.__context__
    return e


def out_of_memory(e: BaseException) -> str | None:
    """XLA's words for a device allocation that did not fit (`Out of memory while trying to allocate 80.95GiB`),
    found anywhere in `e`'s chain of causes and contexts; None for any other error."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if found := _OUT_OF_MEMORY.search(str(current)):
            return found.group(0).strip()
        current = current.__cause__ or current.__context__
    return None
