"""The one exception type users see.

Every check in the project raises `UserError` with a message written for the person at the
keyboard: what is wrong, where it came from (file and key), and how to fix it. The CLI prints it as
one line and exits non-zero; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix: bad recipe, bad flag, unusable checkpoint directory."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None, fix: str | None = None):
        self.key = key
        self.source = source
        self.fix = fix
        parts = []
        if source:
            parts.append(f"{source}:")
        if key:
            parts.append(f"{key}:")
        parts.append(message)
        text = " ".join(parts)
        if fix:
            text += f" Fix: {fix}"
        super().__init__(text)


def root_cause(e: BaseException) -> BaseException:
    """The innermost exception of `e`'s chain (`raise ... from`, or raised while handling another).

    Orbax and MaxText wrap a failed read or write in several layers of their own errors; the outermost
    one (Orbax's "incompatible handler", MaxText's "Checkpointing failed") names the layer that gave
    up, and only the innermost names the file and the cause (ZSTD corruption, no space left on device).
    """
    seen = {id(e)}
    while True:
        nxt = e.__cause__ if e.__cause__ is not None else (None if e.__suppress_context__ else e.__context__)
        if nxt is None or id(nxt) in seen:
            return e
        seen.add(id(nxt))
        e = nxt


def brief(e: BaseException, limit: int = 400) -> str:
    """`Type: message` of `e`, on one line and at most `limit` characters: upstream messages can embed
    whole pytrees (tens of KB), and the rest of them is in the log and under `--traceback`."""
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 4] + " ..."
