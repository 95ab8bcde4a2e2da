"""gin's bindings checked against the table (`check_bound_settings`, `check_args`) and read
back (`bound`, the one place outside gin's own calls)."""
from __future__ import annotations

import os

from mmjax.errors import UserError, shown
from mmjax.settings.check import check
from mmjax.settings.data_table import DATA_SETTINGS, SYNTHETIC_OVERRIDES
from mmjax.settings.run_table import PLAN_SETTINGS, RUN_SETTINGS
from mmjax.settings.setting import Setting

SETTINGS: dict[str, dict[str, Setting]] = {**RUN_SETTINGS, **PLAN_SETTINGS, **DATA_SETTINGS}

_PLAN = "add --plan=auto, --plan=manual or --plan=PLAN.json, or drop the setting"
_NEEDS = {"plan": _PLAN, "auto": "add --plan=auto, or drop the setting",
          "eval": "set train.eval_every=N, or drop the setting",
          "replan": "set train.replan_every=N with a plan, or drop the setting",
          "llava": "set llava_source.json_path, or drop the setting",
          "webdataset": "set webdataset_source.urls, or drop the setting",
          "lora": "set lora.units, or drop the setting"}
_READ = {"plan": "read only with a plan", "auto": "read only with --plan=auto",
         "eval": "read only when train.eval_every > 0",
         "replan": "read only when train.replan_every > 0",
         "llava": "read only with llava_source.json_path",
         "webdataset": "read only with webdataset_source.urls",
         "lora": "read only with lora.units"}


def _modes(plan, eval_every, replan_every) -> set[str]:
    """The modes this run is in (what `Setting.needs` names)."""
    modes = {"plan"} if plan is not None else set()
    if plan == "auto" or (plan is not None and replan_every):
        modes.add("auto")  # re-planning plans with auto_plan's settings too
    if eval_every:
        modes.add("eval")
    if replan_every:
        modes.add("replan")
    if bound("llava_source.json_path"):
        modes.add("llava")
    if bound("webdataset_source.urls"):
        modes.add("webdataset")
    if bound("lora.units"):
        modes.add("lora")
    return modes


def check_bound_settings(units, plan=None, eval_every=0, replan_every=0) -> None:
    """Every gin binding of every configurable in `SETTINGS`: type, range, unknown keys,
    program-set parameters and settings this mode does not read (see the module doc).
    `units`: the model's unit names (for per-unit dicts and `pretrained.*`)."""
    import gin

    modes = _modes(plan, eval_every, replan_every)
    for conf, table in SETTINGS.items():
        try:
            bindings = gin.get_bindings(conf)
        except ValueError:  # the configurable is not registered in this program
            continue
        for key, value in bindings.items():
            name = f"{conf}.{key}"
            if conf == "pretrained":
                _check_pretrained(name, key, value, units)
                continue
            if conf == "synthetic_dataset" and key not in table:
                s = SYNTHETIC_OVERRIDES.get(key)
                if s is None:
                    raise UserError(f"{name}={shown(value)}: synthetic_dataset has no setting "
                                    f"{key!r} (its settings: kind, seed, bad_fraction and the "
                                    f"SyntheticConfig fields {sorted(SYNTHETIC_OVERRIDES)})")
                check(name, value, s)
                continue
            s = table.get(key)
            if s is None:  # gin refuses unknown parameters of fixed signatures at parse
                raise UserError(f"{name}={shown(value)}: {conf} has no setting {key!r}")
            check(name, value, s, units)
            if s.needs is not None and s.needs not in modes and value != s.default:
                raise UserError(f"{name}={shown(value)}: {_READ[s.needs]}, so it would have no "
                                f"effect in this run ({_NEEDS[s.needs]})")


def _check_pretrained(name: str, unit: str, value, units) -> None:
    if units is not None and unit not in units and unit not in ("model", "adapter"):
        raise UserError(f"{name}={shown(value)}: the model has no unit {unit!r} (its units are "
                        f"{list(units)}, `model` for a whole LLaVA / Qwen2-VL checkpoint, or "
                        f"`adapter` for a peft LoRA adapter)")
    if value is not None and not isinstance(value, str):
        raise UserError(f"{name}={shown(value)}: must be the path of a Hugging Face checkpoint "
                        f"directory")
    if value and not os.path.isdir(value):
        raise UserError(f"{name}={shown(value)}: no such directory (a Hugging Face checkpoint "
                        f"directory with config.json and *.safetensors)")


def check_args(conf: str, units=None, **values) -> None:
    """A configurable's arguments as called (gin-bound, passed or defaults), by the same
    table (`units`: the model's unit names, for per-unit dicts)."""
    table = SETTINGS[conf]
    for key, value in values.items():
        check(f"{conf}.{key}", value, table[key], units)


def bound(name: str, default=None):
    """gin's binding of `name` ("configurable.parameter"), or `default` when it is not
    bound: the one place a module reads a binding back instead of receiving it."""
    import gin

    conf, _, key = name.rpartition(".")
    try:
        return gin.get_bindings(conf).get(key, default)
    except ValueError:  # the configurable is not registered in this program
        return default
