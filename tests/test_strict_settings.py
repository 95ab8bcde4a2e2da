"""No setting silently ignored (issue: the first hour of a new user): each formerly ignored
setting is now honoured in both modes or refused with one line, exit 2."""
import os

import gin
import jax.numpy as jnp
import pytest

from helpers import load_script

from mmjax.cli import run_main
from mmjax.data.records import ArrayRecordSource
from mmjax.data.batch_plan import unit_policies
from mmjax.data.loader import Loader  # noqa: F401  (registers `Loader` with gin)
from mmjax.errors import UserError
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.data_config import data_layout
from mmjax.train.single_program import OneDevice
from mmjax.train.whole_model import WholeModelRunner

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))



def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_loader_source_path_is_read_by_the_single_program(tmp_path):
    """`loader_source.path` without --plan: the single program trains the file's samples,
    the very ones a plan's loader selects (was: silently the synthetic set)."""
    data = str(tmp_path / "d.arrayrecord")
    load_script("make_dataset").main(["--model=tiny", "--kind=laion", "--num_samples=24",
                                  "--seed=2", f"--out={data}"])
    cfg = tiny()
    with gin.unlock_config():
        gin.parse_config([f"loader_source.path = '{data}'", "Loader.reserve = 4"])
    try:
        lay = data_layout(cfg)
        runner = WholeModelRunner(cfg, lay, 4, 1e-3, jnp.float32, 0, OneDevice())
        try:
            batches = [next(runner.data)[0] for _ in range(2)]
        finally:
            runner.close()
    finally:
        gin.clear_config()
    want = Loader.build(ArrayRecordSource(data), cfg, Plan.uniform(cfg, 4, 1), lay,
                              unit_policies("none", cfg), reserve=4).builder
    assert [b.sample_ids for b in batches] == [want.stream.select(k)[0] for k in range(2)]


def test_manual_plan_binding_without_plan_manual_is_refused(capsys):
    train = load_script("train")
    assert run_main(train.main, ['--gin_param=manual_plan.dp={"vision": 2}']) == 2
    assert "manual_plan.* is read only with --plan=manual" in _one_error_line(capsys)
    assert run_main(train.main, ["--plan=plan.json", "--gin_param=manual_plan.pp={'llm': 2}"]
                    ) == 2
    _one_error_line(capsys)


def test_misspelt_unit_names_are_refused():
    cfg = tiny()
    with pytest.raises(UserError, match=r"Loader.balance: unknown units \['visoin'\]"):
        unit_policies({"visoin": "orchmllm"}, cfg)
    from mmjax.train.manual_plan import manual_plan
    with pytest.raises(UserError, match=r"^manual_plan.dp=\{'visoin': 2\}: unknown unit\(s\) "
                                         r"\['visoin'\]"):
        manual_plan(global_batch=8, dp={"visoin": 2}, model=cfg)


@pytest.mark.parametrize("script", ["plan", "train"])
def test_misspelt_gin_configurable_is_an_error(capsys, script):
    """`plan.py --gin_param=trian.steps=3` exited 0 (gin's skip_unknown)."""
    argv = [f"--gin_file={REPO}/configs/tiny.gin", "--gin_param=trian.steps=3"]
    if script == "plan":
        argv += ["--gpus=8", "--global_batch=8"]
    try:
        assert run_main(load_script(script).main, argv) == 2
    finally:
        gin.clear_config()
    assert "No configurable matching 'trian'" in _one_error_line(capsys)
