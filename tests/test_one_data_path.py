"""One data path for both modes: the single-program trainer (`train.py`) reads the global
batches every plan reads (the pipeline path's loader), so `train.py` and
`train.py --plan=...` give the same loss curve up to float reassociation."""
import json
import os

import gin
import numpy as np
import pytest

from helpers import load_script

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # ~4 min on the loaded 2-core machine: two trainers' compilations
def test_single_program_and_a_plan_give_the_same_loss_curve(tmp_path):
    cfg = with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                  "generator.num_layers": 1})
    plan_path = str(tmp_path / "plan.json")
    Plan.uniform(cfg, 4, 2, dp={"vision": 2}, pp={"llm": 2}).save(plan_path)
    with gin.unlock_config():
        gin.parse_config(["Loader.reserve = 4", "Loader.seed = 5",
                          "data_layout.seq_len = 128"])
    try:
        run = lambda name, plan, **kw: train(str(tmp_path / name), model=cfg, steps=3,
                                             global_batch=4, progress=False, plan=plan,
                                             checkpoint_every=100, **kw)
        # the plan's last step also runs traced (--trace_steps=3:3): same numbers
        single, planned = run("single", None), run("plan", plan_path, trace_steps="3:3")
    finally:
        gin.clear_config()
    assert [r["step"] for r in single] == [r["step"] for r in planned] == [1, 2, 3]
    # the same samples: the same trained-token counts at every step
    assert [r["tokens_trained"] for r in single] == [r["tokens_trained"] for r in planned]
    np.testing.assert_allclose([r["loss"] for r in planned], [r["loss"] for r in single],
                               rtol=1e-5)
    # --trace_steps: the traced step's actions, rendered as a timeline
    written = load_script("train").render_traces(str(tmp_path / "plan"), "3:3")
    assert written == [str(tmp_path / "plan" / "traces" / "step_3.png")]
    assert os.path.getsize(written[0]) > 1000
    assert not (tmp_path / "plan" / "traces" / "step_2.json").exists()
    with open(tmp_path / "plan" / "traces" / "step_3.json") as f:  # replan.py prices a
        assert json.load(f)["device"] == "cpu"  # trace on the device it names

