"""One data path for both modes: the single-program trainer (`train.py`) reads the global
batches every plan reads (the pipeline path's loader), so `train.py` and
`train.py --plan=...` give the same loss curve up to float reassociation."""
import gin
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.trainer import train


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
        run = lambda name, plan: train(str(tmp_path / name), model=cfg, steps=3,
                                       global_batch=4, progress=False, plan=plan,
                                       checkpoint_every=100)
        single, planned = run("single", None), run("plan", plan_path)
    finally:
        gin.clear_config()
    assert [r["step"] for r in single] == [r["step"] for r in planned] == [1, 2, 3]
    # the same samples: the same trained-token counts at every step
    assert [r["tokens_trained"] for r in single] == [r["tokens_trained"] for r in planned]
    np.testing.assert_allclose([r["loss"] for r in planned], [r["loss"] for r in single],
                               rtol=1e-5)
