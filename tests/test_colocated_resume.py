"""Plan-independent checkpoints across layouts: a run checkpointed co-located at ZeRO-1 (dp
8) resumes co-located at ZeRO-3 with the LLM and the vision encoder at dp 4 x tp 2, and one
checkpointed there resumes as the single program, each with the uninterrupted run's losses
(1e-5)."""
import gin
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
import mmjax.train.manual_plan  # noqa: F401  (registers manual_plan with gin)
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.train.trainer import train

ZERO1 = ['manual_plan.layout = "colocated"', "manual_plan.zero_stage = 1"]
ZERO3_TP2 = ['manual_plan.layout = "colocated"', "manual_plan.zero_stage = 3",
             'manual_plan.tp = {"llm": 2, "vision": 2}']


def small_tiny():
    return with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                   "generator.num_layers": 1})


@pytest.mark.slow
def test_resume_switches_layout_and_zero_stage(tmp_path):
    cfg = small_tiny()
    cache = str(tmp_path / "cache")

    def run(name, bindings, plan="manual", **kw):
        gin.clear_config()
        with gin.unlock_config():
            gin.parse_config(["Loader.reserve = 4", "Loader.seed = 5",
                              "data_layout.seq_len = 128"] + (bindings if plan else []))
        return [r["loss"] for r in train(str(tmp_path / name), model=cfg, steps=4,
                                         global_batch=8, progress=False, plan=plan,
                                         checkpoint_every=2, compilation_cache_dir=cache,
                                         **kw) if "loss" in r]
    try:
        straight = run("a", ZERO1)
        assert len(run("b", ZERO1, stop_after=2)) == 2
        zero3 = run("b", ZERO3_TP2)
        assert len(run("c", ZERO3_TP2, stop_after=2)) == 2
        single = run("c", [], plan=None)
    finally:
        gin.clear_config()
    assert len(straight) == 4
    np.testing.assert_allclose(zero3, straight[2:], rtol=1e-5)
    np.testing.assert_allclose(single, straight[2:], rtol=1e-5)
