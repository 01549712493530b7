"""`errors.root_cause` and `errors.brief`: the one line every translated upstream error is built from."""

from __future__ import annotations

from maxtext_moe.errors import brief, root_cause


def _chain() -> BaseException:
    """Orbax's shape: a decoding error, re-raised `from` it, then another raised while handling that."""
    try:
        try:
            try:
                raise ValueError("ZSTD_decompressStream() failed: Unknown frame descriptor")
            except ValueError as e:
                raise Exception("Encountered error while reading array index") from e
        except Exception:
            raise KeyError("incompatible handler " + "x" * 80_000) from None
    except KeyError:
        try:
            raise RuntimeError("Checkpointing failed.")
        except RuntimeError as outer:
            return outer


def test_the_innermost_error_of_a_chain_is_found_and_suppressed_context_is_respected():
    outer = _chain()
    cause = root_cause(outer)
    assert isinstance(cause, KeyError), "`from None` hides what came before the KeyError"
    inner = cause.__context__
    assert isinstance(root_cause(inner), ValueError) and "ZSTD" in str(root_cause(inner))
    e = ValueError("alone")
    assert root_cause(e) is e


def test_brief_is_one_short_line():
    text = brief(root_cause(_chain()), limit=200)
    assert text.startswith("KeyError: 'incompatible handler xxx") and text.endswith(" ...") and len(text) == 200
    assert brief(OSError("two\nlines")) == "OSError: two lines"
    assert brief(StopIteration()) == "StopIteration"


def test_a_cycle_in_the_chain_ends():
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert root_cause(a) is b
