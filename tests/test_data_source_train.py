"""The pipelined trainer reads a gin-bound ArrayRecord dataset written by
scripts/make_dataset.py (`loader_source.path`), decoding in the loader (DistTrain §4.2)."""
import importlib.util
import json
import os

import gin
import numpy as np

from mmjax.data.loader import ArrayRecordSource, GlobalBatchBuilder, _policies
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.plan import Plan
from mmjax.train.trainer import data_layout, train

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "make_dataset.py")
_spec = importlib.util.spec_from_file_location("make_dataset_script", _PATH)
make_dataset = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_dataset)


def test_pipelined_training_from_make_dataset_arrayrecord(tmp_path):
    data = str(tmp_path / "tiny.arrayrecord")
    make_dataset.main(["--model=tiny", "--kind=laion", "--num_samples=40", "--seed=1",
                       "--corrupt_fraction=0.3", f"--out={data}"])
    src = ArrayRecordSource(data)
    assert len(src) == 40 and src.patch_size == 4 and src.max_grid == 16
    cfg = with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                  "generator.num_layers": 1})
    plan_path = str(tmp_path / "plan.json")
    Plan.uniform(cfg, 4, 2, dp={"vision": 2}, pp={"llm": 2}).save(plan_path)
    with gin.unlock_config():
        gin.parse_config([f"loader_source.path = '{data}'", "Loader.balance = 'orchmllm'",
                          "Loader.reserve = 8"])
    try:
        recs = train(str(tmp_path / "run"), model=cfg, steps=2, global_batch=4,
                     progress=False, plan=plan_path, checkpoint_every=100)
    finally:
        gin.clear_config()
    assert [r["step"] for r in recs] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["loss"] > 0 for r in recs)
    # exactly the file's skips: bad shapes, and truncated records (blanked, counted) that
    # the synthetic fallback does not have
    builder = GlobalBatchBuilder(src, cfg, Plan.load(plan_path), data_layout(cfg),
                                 _policies("orchmllm", cfg), reserve=8)
    gbs = [builder(step) for step in range(2)]
    assert sum(g.skip_reasons.get("decode", 0) for g in gbs) > 0
    assert [r["skipped_samples"] for r in recs] == list(np.cumsum([g.skipped_samples
                                                                   for g in gbs]))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 2]
