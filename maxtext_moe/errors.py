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
