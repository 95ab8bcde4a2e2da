"""`Setting`: one gin setting's kind, bounds, default and the mode it needs (no JAX)."""
from __future__ import annotations

from dataclasses import dataclass

INT_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Setting:
    """kind: "int" | "float" | "bool" | "str" | "choice" | "file" | "dir" | "ints" (a
    non-empty list of ints) | "strs" (a string or a list of them) | "names" (a name or a
    list of them, empty allowed) | "program" (set by the
    program: a binding has no effect) | "plan" (None, "manual", "auto" or a Plan JSON file)
    | "span" ("A:B", 1 <= A <= B). `lo` / `hi` bound numbers (`open_lo` / `open_hi`
    exclusive); `per_unit`: a dict unit -> value is accepted too; `needs`: "plan", "auto"
    or "eval", the mode without which a value other than `default` has no effect;
    `off_or_above_one`: a number that is 0 (off) or > 1."""
    kind: str
    default: object = None
    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False
    open_hi: bool = False
    choices: tuple = ()
    none: bool = False
    per_unit: bool = False
    needs: str | None = None
    fix: str = ""
    off_or_above_one: bool = False


def _int(default, lo=0, hi=INT_MAX, **kw):
    return Setting("int", default, lo, hi, **kw)


def _float(default, lo=None, hi=None, **kw):
    return Setting("float", default, lo, hi, **kw)


_PROGRAM = Setting("program")
_BOOL = {True: Setting("bool", True), False: Setting("bool", False)}
