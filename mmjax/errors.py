"""The error type for bad user input (settings, files, plans): its message is one line
saying what is wrong and how to fix it; the CLIs print it as `error: <message>` and exit 2.
A subclass of ValueError, so callers that catch ValueError keep working."""
from __future__ import annotations


class UserError(ValueError):
    """Bad input, reported in one line (what, and how to fix it); no traceback."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one short line: its root cause's type and first words."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"
