"""Every setting typed and ranged in one table (mmjax/settings.py): the table covers every
configurable's parameters with their defaults, and a seeded sample of the settings fuzz
(scripts/fuzz_settings.py, run in full there) gives no invalid value accepted, no valid
one refused, no traceback, no hang and no workdir left by a refused run."""
import dataclasses
import inspect

import pytest

from helpers import load_script

from mmjax.errors import UserError
from mmjax.settings import SETTINGS, SYNTHETIC_OVERRIDES, check, synthetic_fields

FUZZ = load_script("fuzz_settings")


def test_the_table_covers_every_configurable_parameter_with_its_default():
    funcs = FUZZ._configurables()
    for conf, table in SETTINGS.items():
        params = {k: p for k, p in inspect.signature(funcs[conf]).parameters.items()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        assert sorted(params) == sorted(table), conf
        for k, p in params.items():
            s = table[k]
            if s.kind != "program" and p.default is not p.empty:
                assert s.default == p.default, (conf, k)
                assert check(f"{conf}.{k}", p.default, s) is None  # defaults are valid
    fields = {f.name: f.default for f in dataclasses.fields(
        __import__("mmjax.data.synthetic", fromlist=["x"]).SyntheticConfig)}
    assert sorted(SYNTHETIC_OVERRIDES) == sorted(synthetic_fields())
    for k, s in SYNTHETIC_OVERRIDES.items():
        if s.kind != "program":
            assert s.default == fields[k], k


def test_errors_name_the_setting_value_reason_and_fix():
    with pytest.raises(UserError) as e:
        check("OptimizerSettings.b1", -0.5, SETTINGS["OptimizerSettings"]["b1"])
    assert str(e.value) == ("OptimizerSettings.b1=-0.5: must be a number >= 0 and < 1 "
                            "(the default is 0.9)")
    with pytest.raises(UserError, match=r"^Loader.balance\[.visoin.\]|unknown unit"):
        check("Loader.balance", {"visoin": "orchmllm"}, SETTINGS["Loader"]["balance"],
              units=("vision", "llm"))


def test_seeded_settings_fuzz_sample(tmp_path):
    results = FUZZ.fuzz(150, seed=7, timeout=60)
    counts = FUZZ.table(results)
    bad = [r for r in results if FUZZ.verdict(r) in ("invalid accepted", "valid refused",
                                                     "traceback", "hang") or r["workdir_left"]]
    assert not bad, bad[:5]
    assert counts.get("invalid refused", 0) > 80 and counts.get("valid accepted", 0) > 5
