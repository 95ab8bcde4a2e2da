"""Dotted-path overrides of a frozen config tree (`with_overrides`), each value checked
against the one it replaces: the machinery behind `named_model_config.overrides`."""
from __future__ import annotations

import dataclasses

from mmjax.errors import UserError


def with_overrides(cfg, overrides: dict | None):
    """Apply dotted-path overrides, e.g. {"llm.num_layers": 2, "encoders.vision.frozen": True}.

    All overrides of one dataclass are applied in one `replace`, so options that are only
    valid together (a ViT's `kind="vit"` with its `class_token`) work in any key order.
    Raises UserError naming the bad path, so a typo in a gin binding fails before any work.
    """
    if overrides is not None and not isinstance(overrides, dict):
        raise UserError(f"named_model_config.overrides={overrides!r}: must be a dict of "
                        f"dotted paths to values, e.g. {{'llm.num_layers': 2}}")
    tree: dict = {}
    for path, value in (overrides or {}).items():
        if not isinstance(path, str) or not path:
            raise UserError(f"override {path!r}: keys are dotted paths such as "
                            f"'llm.num_layers'")
        node = tree
        for part in path.split("."):
            node = node.setdefault(part, {})
        node.clear()  # a whole value replaces what earlier overrides set below it
        node[_VALUE] = (value, path)
    return _apply(cfg, tree, "")


_VALUE = object()  # key of a path's own value in the override tree


def _apply(obj, tree: dict, prefix: str):
    """`obj` with the override subtree applied (a node's own value first, then its children)."""
    if _VALUE in tree:
        obj = _typed(obj, *tree[_VALUE])
    children = {k: v for k, v in tree.items() if k is not _VALUE}
    if not children:
        return obj
    if isinstance(obj, tuple):  # encoders: select by name
        out = list(obj)
        for head, sub in children.items():
            idx = [i for i, item in enumerate(out) if getattr(item, "name", None) == head]
            if not idx:
                raise UserError(f"override {_first_path(sub)!r}: no element named {head!r}")
            out[idx[0]] = _apply(out[idx[0]], sub, prefix + head + ".")
        return tuple(out)
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
    for head, sub in children.items():
        if head not in names:
            raise UserError(f"override {_first_path(sub)!r}: {type(obj).__name__} has no field "
                            f"{head!r}; fields: {names}")
    return dataclasses.replace(obj, **{head: _apply(getattr(obj, head), sub, prefix + head + ".")
                                       for head, sub in children.items()})


def _typed(old, new, path: str):
    """`new` if it can replace the config value `old`: the same type (an int for a float),
    and a size that is positive (non-negative) stays so; else a UserError naming the path."""
    def bad(why):
        return UserError(f"override {path!r}={new!r}: {why} (the current value is {old!r})")
    if dataclasses.is_dataclass(old) and new is not None and not isinstance(new, type(old)):
        raise UserError(f"override {path!r}={new!r}: must be a {type(old).__name__} "
                        f"(override its fields one by one, e.g. {path}.<field>)")
    if isinstance(old, bool) or old is None or dataclasses.is_dataclass(old):
        if isinstance(old, bool) and not isinstance(new, bool):
            raise bad("must be True or False")
        return new
    if isinstance(old, (int, float)):
        num = isinstance(new, (int, float)) and not isinstance(new, bool)
        if not num or (isinstance(old, int) and not isinstance(new, int)):
            raise bad(f"must be {'an int' if isinstance(old, int) else 'a number'}")
        if new != new or new in (float("inf"), float("-inf")):
            raise bad("must be finite")
        if (old > 0 and new <= 0) or (old >= 0 and new < 0):
            raise bad("must be " + ("> 0" if old > 0 else ">= 0"))
    elif isinstance(old, str) and not isinstance(new, str):
        raise bad("must be a string")
    elif isinstance(old, tuple) and not isinstance(new, (tuple, list)):
        raise bad("must be a list")
    return tuple(new) if isinstance(old, tuple) else new


def _first_path(tree: dict) -> str:
    """The full dotted path of the first override under `tree` (for error messages)."""
    while _VALUE not in tree:
        tree = next(iter(tree.values()))
    return tree[_VALUE][1]
