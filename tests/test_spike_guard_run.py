"""The loss-spike guard end to end (issue 28): a tiny run on crafted data whose loss
falls fast (every token the same) and jumps more than `train.spike_factor` x its running
median on the batches of random tokens. The spiking steps are held back (not applied: the
checkpoint's step and optimizer counts skip them), counted in metrics.jsonl and logged; a
checkpoint that falls due inside a streak that recovers is written at the first good step;
a streak of `max_bad_steps` stops the run naming the last good checkpoint."""
import dataclasses
import json
import os

import gin
import jax
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.data.records import write_dataset
from mmjax.data.sample import FIRST_TEXT_ID, Sample, Segment
from mmjax.models.config import EncoderSpec, MLLMConfig, ProjectorConfig
from mmjax.models.tiny import TINY_LLM, TINY_VISION

GB, LENGTH, STEPS = 2, 24, 16
SPIKES = (7, 8, 12, 13, 14)  # a streak of 2 that recovers, then one of 3 that stops the run


def _counts(ckpt_dir: str) -> set:
    """The 0-d integer leaves of a checkpoint's state: the train step and the optimizer's
    update counts, i.e. how many updates were applied."""
    import orbax.checkpoint as ocp
    tree = ocp.StandardCheckpointer().restore(os.path.join(ckpt_dir, "state"))
    return {int(x) for x in jax.tree.leaves(tree)
            if np.ndim(x) == 0 and np.issubdtype(np.asarray(x).dtype, np.integer)}


@pytest.mark.slow
def test_spikes_are_held_back_counted_logged_and_a_streak_stops_the_run(tmp_path, capfd):
    from mmjax.train.trainer import TrainingStopped, train

    cfg = MLLMConfig("tiny_spike", dataclasses.replace(TINY_LLM, num_layers=1, hidden_size=32,
                                                       ffn_size=64),
                     encoders=(EncoderSpec("vision", dataclasses.replace(
                         TINY_VISION, num_layers=1, hidden_size=16, ffn_size=32),
                         ProjectorConfig(downsample=1)),))
    rng = np.random.default_rng(0)
    samples = []
    for i in range(GB * STEPS):  # in order, no reserve: step n reads samples 2n-2, 2n-1
        ids = (rng.integers(FIRST_TEXT_ID, cfg.llm.vocab_size, LENGTH)
               if i // GB + 1 in SPIKES else np.full(LENGTH, FIRST_TEXT_ID + 5))
        samples.append(Sample(i, (Segment("text", ids.astype(np.int32)),)))
    data = str(tmp_path / "spiky.arrayrecord")
    write_dataset(data, samples, patch_size=TINY_VISION.patch_size, max_grid=8)
    work = str(tmp_path / "run")
    gin.clear_config()
    gin.parse_config([f"loader_source.path = '{data}'", "Loader.shuffle = False",
                      "Loader.reserve = 0", "learning_rate_schedule.peak_lr = 1e-2",
                      "learning_rate_schedule.warmup_steps = 0"])
    try:
        with pytest.raises(TrainingStopped) as stop:
            train(work, model=cfg, steps=STEPS, global_batch=GB, progress=False,
                  checkpoint_every=2, spike_factor=3.0, spike_window=4, max_bad_steps=3)
    finally:
        gin.clear_config()
    msg = str(stop.value)
    assert "3 steps in a row (12..14)" in msg and "none was applied" in msg
    assert f"Last good checkpoint: step 10 in {os.path.join(work, 'checkpoints')}" in msg
    rows = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, 15))
    assert all(np.isfinite(r["loss"]) and r["nonfinite_steps"] == 0 for r in rows)
    assert [r["spike_steps"] for r in rows] == [sum(s <= n for s in SPIKES)
                                               for n in range(1, 15)]
    good = [r["loss"] for r in rows if r["step"] not in SPIKES]
    for r in rows:  # each spike was a real one: above 3 x the median of the good ones before
        if r["step"] in SPIKES:
            before = [x["loss"] for x in rows[:r["step"] - 1] if x["step"] not in SPIKES]
            assert r["loss"] > 3 * np.median(before[-4:])
    assert good[-1] < good[0]
    out = capfd.readouterr().err  # the run's console is stderr
    for n, k in zip(SPIKES, (1, 2, 1, 2, 3)):
        assert f"step {n}: loss " in out and f"not applied (loss-spike guard, {k} in a row)" in out
    # checkpoint 8 fell due in the first streak: written at step 9, the first good step;
    # none inside either streak; every checkpoint counts only the applied updates
    ckpts = os.path.join(work, "checkpoints")
    assert sorted(map(int, os.listdir(ckpts))) == [6, 9, 10]
    assert _counts(os.path.join(ckpts, "6")) == {6}
    assert _counts(os.path.join(ckpts, "9")) == {7}  # steps 7 and 8 held back
    assert _counts(os.path.join(ckpts, "10")) == {8}
