"""Every gin setting's type and range, in one table (no JAX), checked before any work.

`SETTINGS[configurable][parameter]` is a `Setting`: its kind (int, float, bool, str, a
choice, a path, a per-unit dict), its bounds, whether None is allowed, its default, and the
mode it needs (a plan, `--plan=auto`, an evaluation set) when it has no effect otherwise.
Choice lists come from the modules that act on them. `bound` is the one place gin's bindings
are read back (outside gin's own calls).
`check_bound_settings` (settings/bindings.py) walks gin's bindings of every configurable (`gin.get_bindings`) and
raises `UserError("<setting>=<value>: <why> (<fix>)")` for the first bad one: wrong type,
out of range, an unknown key inside a dict or `**overrides`, a parameter the program sets
itself, or a setting that this mode never reads. scripts/train.py prints it as
`error: ...` and exits 2 before anything is written.
"""
from __future__ import annotations

from mmjax.settings.bindings import SETTINGS, bound, check_args, check_bound_settings
from mmjax.settings.check import check, problem
from mmjax.settings.data_table import SYNTHETIC_OVERRIDES, synthetic_fields
from mmjax.settings.run_table import COMPUTE_DTYPES
from mmjax.settings.setting import INT_MAX, Setting, _float, _int

__all__ = ["COMPUTE_DTYPES", "INT_MAX", "SETTINGS", "SYNTHETIC_OVERRIDES", "Setting", "_float",
           "_int", "bound", "check", "check_args", "check_bound_settings", "problem",
           "synthetic_fields"]
