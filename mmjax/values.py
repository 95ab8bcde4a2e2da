"""Predicates on plain setting values (no JAX), shared by the settings table
(mmjax/settings.py) and the checks of settings it cannot express alone
(train/colocated_plan.py)."""
from __future__ import annotations


def is_int(v) -> bool:
    """An int that is not a bool (gin and JSON give True where a count is meant)."""
    return isinstance(v, int) and not isinstance(v, bool)
