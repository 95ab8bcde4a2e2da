"""Issue 28: when every checkpoint of a run is unusable, the rerun says so and starts from
step 0 (the damaged ones set aside, not deleted), removes the temporary directory an
unfinished save left, and then trains exactly as the first run did."""
import dataclasses
import json
import os
import shutil

import gin
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.models.config import EncoderSpec, MLLMConfig, ProjectorConfig
from mmjax.models.tiny import TINY_LLM, TINY_VISION


@pytest.mark.slow
def test_every_checkpoint_unusable_says_it_starts_from_step_0(tmp_path, capfd):
    from mmjax.train.trainer import train

    cfg = MLLMConfig("tiny_fresh", dataclasses.replace(TINY_LLM, num_layers=1, hidden_size=32,
                                                       ffn_size=64),
                     encoders=(EncoderSpec("vision", dataclasses.replace(
                         TINY_VISION, num_layers=1, hidden_size=16, ffn_size=32),
                         ProjectorConfig(downsample=1)),))
    work = str(tmp_path / "run")

    def run():
        gin.clear_config()
        gin.parse_config(["data_layout.seq_len = 64", "data_layout.vision_caps = (64,)",
                          "Loader.reserve = 16", "Loader.max_bad_fraction = 0.9"])
        try:
            return train(work, model=cfg, steps=2, global_batch=4, progress=False,
                         checkpoint_every=1)
        finally:
            gin.clear_config()

    first = run()
    ckpts = os.path.join(work, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["1", "2"]
    for step in ("1", "2"):  # both damaged: their arrays gone
        shutil.rmtree(os.path.join(ckpts, step, "state"))
    os.makedirs(os.path.join(ckpts, "3.orbax-checkpoint-tmp-99"))  # a save killed mid-write
    capfd.readouterr()
    again = run()
    err = capfd.readouterr().err
    assert f"removed 3.orbax-checkpoint-tmp-99, the temporary directory of an unfinished " \
           f"save, from {ckpts}" in err
    assert (f"no usable checkpoint in {work}/checkpoints (set aside: steps [2, 1]): "
            f"starting from step 0") in err
    assert sorted(os.listdir(ckpts + ".unusable")) == ["1", "2"]  # kept for inspection
    assert [r["step"] for r in again] == [1, 2]
    assert [r["loss"] for r in again] == [r["loss"] for r in first]
    rows = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]  # each step once
    assert sorted(os.listdir(ckpts)) == ["1", "2"]
