"""The error type for bad user input (settings, files, plans): its message is one line
saying what is wrong and how to fix it; the CLIs print it as `error: <message>` and exit 2.
Every user-facing error type subclasses it (PlanError, PretrainedError, CheckpointMismatch);
it is not a ValueError, so `except UserError` catches bad input and never hides a bug."""
from __future__ import annotations


class UserError(Exception):
    """Bad input, reported in one line (what, and how to fix it); no traceback."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line: its root cause's type and first words."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def shown(value, limit: int = 80) -> str:
    """`repr(value)` for an error message, cut to `limit` characters (a 5000-character
    value is named by its start and length, not echoed whole)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def first_line(e: BaseException) -> str:
    """An exception's first line: gin appends "In call to configurable ..." on further
    lines of an exception raised inside a configurable; the first says it all."""
    return (str(e).splitlines() or [type(e).__name__])[0]
