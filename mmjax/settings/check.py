"""`check`: one value against its `Setting`, as a one-line `UserError` (no JAX)."""
from __future__ import annotations

import math
import os

from mmjax.errors import UserError, shown
from mmjax.settings.setting import INT_MAX, Setting
from mmjax.values import is_int

_WHAT = {"int": "an int", "float": "a number", "bool": "True or False", "str": "a string",
         "file": "a file path", "dir": "a directory path", "dict": "a dict",
         "ints": "a non-empty list of ints", "strs": "a string or a list of strings",
         "names": "a name or a list of names",
         "range": "a pair (lo, hi) of ints with lo <= hi", "ints3": "three ints"}


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _num(x) -> str:
    return f"{x:,}" if is_int(x) and x >= 10_000 else f"{x:g}"


def _range_text(s: Setting, value=None) -> str:
    """The accepted range; the implicit upper bound (INT_MAX) only for a value above it."""
    lo = "" if s.lo is None else f"{'>' if s.open_lo else '>='} {_num(s.lo)}"
    above = _is_num(value) and value > s.hi if s.hi is not None else False
    hi = "" if s.hi is None or (s.hi == INT_MAX and not above) else \
        f"{'<' if s.open_hi else '<='} {_num(s.hi)}"
    return " and ".join(x for x in (lo, hi) if x)


def _in_range(v, s: Setting) -> bool:
    if s.lo is not None and (v < s.lo or (s.open_lo and v == s.lo)):
        return False
    return s.hi is None or not (v > s.hi or (s.open_hi and v == s.hi))


def problem(value, s: Setting) -> str | None:
    """Why `value` is not a valid value of `s` (None: it is)."""
    if value is None and s.none:
        return None
    k = s.kind
    if k == "choice":
        if not any(type(value) is type(c) and value == c for c in s.choices):
            return f"must be one of {list(s.choices)}" + (" or None" if s.none else "")
        return None
    if k in ("int", "float"):
        ok = is_int(value) if k == "int" else (_is_num(value) and math.isfinite(value))
        if not ok or not _in_range(value, s):
            extra = ", or None" if s.none else ""
            return f"must be {_WHAT[k]} {_range_text(s, value)}{extra}".rstrip()
        if s.off_or_above_one and 0 < value <= 1:
            return "must be 0 (off) or > 1"
        return None
    if k == "plan":
        if not isinstance(value, str):
            return "must be a Plan JSON path, 'manual', 'auto' or None"
        return None if value in ("manual", "auto") or os.path.isfile(value) else "no such file"
    if k == "span":
        a, sep, b = value.partition(":") if isinstance(value, str) else ("", "", "")
        span = bool(sep) and a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)
        return None if span else "use 'A:B' with 1 <= A <= B"
    if k == "bool":
        return None if isinstance(value, bool) else "must be True or False"
    if k in ("str", "file", "dir"):
        if not isinstance(value, str) or (k != "str" and not value):
            return f"must be {_WHAT[k]}" + (" or None" if s.none else "")
        if k == "file" and not os.path.isfile(value):
            return "no such file"
        if k == "dir" and not os.path.isdir(value):
            return "no such directory"
        return None
    if k == "dict":
        if not isinstance(value, dict):
            return "must be a dict"
        return None if value else "an empty dict changes nothing (drop the binding)"
    if k in ("ints", "range", "ints3"):
        items = list(value) if isinstance(value, (list, tuple)) else None
        want = {"range": 2, "ints3": 3}.get(k)
        if (not items or (want and len(items) != want)
                or not all(is_int(x) and _in_range(x, s) for x in items)
                or (k == "range" and items[0] > items[1])):
            return f"must be {_WHAT[k]}, each {_range_text(s)}"
        return None
    if k == "names":  # an empty list: none
        names = bool(isinstance(value, str) and value or isinstance(value, (list, tuple)) and all(
            isinstance(x, str) and x for x in value))
        return None if names else f"must be {_WHAT[k]}"
    if k == "strs":
        if isinstance(value, str) and value:
            return None
        if isinstance(value, (list, tuple)) and value and all(
                isinstance(x, str) and x for x in value):
            return None
        return "must be a path or URL pattern, or a non-empty list of them"
    raise AssertionError(k)


def check(name: str, value, s: Setting, units=None) -> None:
    """Raise `UserError("name=value: why (fix)")` when `value` is not valid for `s`."""
    if s.kind == "program":
        effect = s.fix or "a binding has no effect"
        raise UserError(f"{name}={shown(value)}: set by the program itself ({effect}; drop the "
                        f"binding)")
    if s.per_unit and isinstance(value, dict):
        unknown = [u for u in value if units is not None and u not in units]
        if unknown:
            raise UserError(f"{name}={shown(value)}: unknown unit(s) {unknown} (the model's units "
                            f"are {list(units)})")
        for u, v in value.items():
            unit_why = problem(v, s)
            if unit_why:
                raise UserError(f"{name}[{u!r}]={shown(v)}: {unit_why} "
                                f"({s.fix or 'see its docstring'})")
        return
    why = problem(value, s)
    if why:
        fix = s.fix or (f"the default is {s.default!r}" if s.default is not None else
                        "see the docstring of " + name.split(".")[0])
        raise UserError(f"{name}={shown(value)}: {why} ({fix})")
