"""The run spec (train/run_spec.py): `train.*` in gin binds RunSpec's fields, each checked by
the settings table as the spec is built; and a user error is a `UserError`, never a
`ValueError`, so `run_main` reports bad input in one line and lets a bug's traceback through."""
import dataclasses

import gin
import pytest

from mmjax.cli import EXIT_USER_ERROR, run_main
from mmjax.errors import UserError
from mmjax.planner.plan import PlanError
from mmjax.settings import SETTINGS
from mmjax.train.run_spec import RunSpec


@pytest.fixture
def clean_gin():
    gin.clear_config()
    yield
    gin.clear_config()


def test_fields_are_the_tables_train_settings_with_its_defaults():
    table = SETTINGS["train"]
    spec = RunSpec()
    assert sorted(f.name for f in dataclasses.fields(RunSpec)) == sorted(table)
    for f in dataclasses.fields(RunSpec):
        if table[f.name].kind != "program":
            assert getattr(spec, f.name) == table[f.name].default, f.name


def test_from_gin_takes_the_bindings_with_given_fields_over_them(clean_gin, tmp_path):
    gin.parse_config("train.steps = 3\ntrain.global_batch = 4\ntrain.plan = 'manual'")
    spec = RunSpec.from_gin(global_batch=16, dry_run=True)
    assert (spec.steps, spec.global_batch, spec.plan, spec.dry_run) == (3, 16, "manual", True)
    assert RunSpec().steps == 30  # the dataclass itself reads no gin
    with pytest.raises(ValueError, match="train.*stepz"):  # gin's own parse error
        gin.parse_config("train.stepz = 3")


@pytest.mark.parametrize("kw, line", [
    ({"steps": 0}, "train.steps=0: must be an int >= 1 (the default is 30)"),
    ({"compute_dtype": "fp8"}, "train.compute_dtype='fp8': must be one of ['float32', "
                               "'bfloat16'] (the default is 'float32')"),
    ({"spike_factor": 0.5}, "train.spike_factor=0.5: must be 0 (off) or > 1 (0 turns the "
                            "guard off; else a step above that many times the median is held "
                            "back, e.g. 100)"),
    ({"plan": "manual", "trace_steps": "4:3"}, "train.trace_steps='4:3': use 'A:B' with "
                                               "1 <= A <= B (e.g. '3:4')"),
    ({"plan": "nope.json"}, "train.plan='nope.json': no such file (a Plan JSON from "
                            "scripts/plan.py --json, 'auto', or 'manual' with manual_plan.* "
                            "bindings)"),
    ({"trace_steps": "1:2"}, "train.trace_steps traces the pipeline runtime's actions: add "
                             "--plan=manual (or a Plan JSON); the single program is one XLA "
                             "program (profile it with jax.profiler)"),
])
def test_each_field_is_checked_as_the_spec_is_built(kw, line):
    with pytest.raises(UserError) as e:
        RunSpec(**kw)
    assert str(e.value) == line


def test_the_spec_is_frozen_and_reads_its_trace_range():
    spec = RunSpec(plan="manual", trace_steps="3:5")
    assert spec.trace_range == (3, 5) and RunSpec().trace_range == (1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.steps = 2  # type: ignore[misc]
    assert spec.replace(steps=2).steps == 2 and spec.steps == 30


def test_user_errors_are_not_value_errors_so_bugs_keep_their_traceback(capsys):
    assert not issubclass(UserError, ValueError) and issubclass(PlanError, UserError)

    def bad_input(argv):
        raise PlanError("plan.json: no stage fits (add GPUs)")

    def bug(argv):
        raise ValueError("an internal invariant broke")

    assert run_main(bad_input, []) == EXIT_USER_ERROR
    assert capsys.readouterr().err == "error: plan.json: no stage fits (add GPUs)\n"
    with pytest.raises(ValueError, match="internal invariant"):
        run_main(bug, [])
