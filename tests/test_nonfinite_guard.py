"""Non-finite steps are not applied (both training paths, selected on device), a streak
stops the run with the last good checkpoint intact, and metrics.jsonl keeps each step once
across resumes."""
import dataclasses
import json
import os

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh

from zero1_legacy import Zero1Reference
from mmjax.train.global_norm import fold_loss as _fold_loss
from mmjax.train.state import WHOLE_MODEL, whole_model_state
from mmjax.train.step import make_train_step, split_model


class SqrtModel(nnx.Module):
    """loss = sum(sqrt(w * x)): x = 0 gives a finite loss with a NaN gradient."""

    def __init__(self):
        self.w = nnx.Param(jnp.full((4,), 2.0))

    def __call__(self, batch, dtype, attention_impl="auto", llm_mask_family="bam"):
        loss = jnp.sum(jnp.sqrt(self.w[...] * batch["x"]))
        return loss, {"lm_loss": loss, "diffusion_loss": jnp.zeros(())}


def _copy(tree):
    return [np.array(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def sqrt_step():
    graphdef, trainable, frozen = split_model(SqrtModel(), nnx.Param)
    steps = {}
    for lr in (0.1, 1e38):  # 1e38: finite loss and gradient, the update overflows
        tx = optax.sgd(lr)
        step = make_train_step(graphdef, tx)
        steps[lr] = (lambda s, *a, step=step: step(s, frozen, *a),
                     lambda tx=tx: whole_model_state(  # copies: donated
                         jax.tree.map(jnp.copy, trainable), tx.init(trainable),
                         jnp.zeros((), jnp.int32)))
    return steps


@pytest.mark.parametrize("case", ["nan loss", "nan gradient", "overflowing update"])
def test_single_program_step_is_skipped_on_device_and_counted(sqrt_step, case):
    lr = 1e38 if case == "overflowing update" else 0.1
    step, init = sqrt_step[lr]
    x = {"nan loss": [1.0, np.nan, 1.0, 1.0], "nan gradient": [1.0, 0.0, 1.0, 1.0],
         "overflowing update": [1e4, 1e4, 1e4, 1e4]}[case]
    state = init()
    before = _copy(state)
    state, m = step(state, {"x": jnp.asarray(x, jnp.float32)})
    assert float(m["nonfinite"]) == 1.0 and int(state.step) == 0
    if case == "nan gradient":
        assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    for a, b in zip(before, _copy(state)):
        np.testing.assert_array_equal(a, b)  # parameters and optimizer state untouched
    if lr == 0.1:  # a good batch afterwards is applied as usual
        state, m = step(state, {"x": jnp.ones(4, jnp.float32)})
        assert float(m["nonfinite"]) == 0.0 and int(state.step) == 1
        assert not np.array_equal(before[0], np.asarray(jax.tree.leaves(
            state.stages[WHOLE_MODEL].master)[0]))


def test_zero1_update_skips_when_the_folded_norm_is_not_finite():
    mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("dp", "tp"))
    params = {"w": jnp.arange(8.0, dtype=jnp.float32).reshape(4, 2)}
    opt = Zero1Reference(optax.adam(0.1), mesh, params, clip_norm=1.0)
    state = opt.init(params)
    grads = {"w": jnp.ones((4, 2), jnp.float32)}
    norm = jnp.sqrt(jnp.float32(8.0))
    ok = _fold_loss(norm, [jnp.float32(1.5), jnp.float32(2.0)])
    assert np.asarray(ok).tobytes() == np.asarray(norm).tobytes()  # bit-identical when finite
    bad = _fold_loss(norm, [jnp.float32(1.5), jnp.float32(np.inf)])
    assert np.isnan(float(bad))
    before = _copy((params, state))
    p2, s2 = opt.update(params, grads, state, bad)
    for a, b in zip(before, _copy((p2, s2))):
        np.testing.assert_array_equal(a, b)
    p3, _ = opt.update(params, grads, state, ok)
    assert not np.array_equal(np.asarray(p3["w"]), before[0])


def test_truncate_metrics_keeps_each_step_once_up_to_the_restored_one(tmp_path):
    from mmjax.train.run_files import truncate_metrics

    path = str(tmp_path / "metrics.jsonl")
    rows = [{"step": s, "loss": float(s)} for s in (1, 2, 3, 2, 3, 4, 5)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 6, "lo')  # cut short by a kill
    truncate_metrics(path, 3)
    got = [json.loads(x) for x in open(path)]
    assert [r["step"] for r in got] == [1, 2, 3]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]  # temp file replaced, none left
    truncate_metrics(path, 0)
    assert open(path).read() == ""
    skips = str(tmp_path / "skipped.jsonl")  # several rows per step, all kept in order
    with open(skips, "w") as f:
        f.writelines(json.dumps({"step": s, "id": k}) + "\n" for s, k in
                     [(1, "a"), (2, "b"), (2, "c"), (3, "d"), (2, "e")])
    truncate_metrics(skips, 2, one_per_step=False)
    assert [json.loads(x)["id"] for x in open(skips)] == ["a", "b", "c", "e"]


@pytest.mark.slow
def test_diverging_run_stops_keeps_good_checkpoint_and_resume_writes_each_step_once(
        tmp_path, monkeypatch):
    """2 good steps (checkpoint 2); rerun at lr 1e30: steps go non-finite, are skipped, and
    after max_bad_steps the run stops naming checkpoint 2, which stays (keep_checkpoints=1)
    and verifies; a rerun at a sane lr resumes from 2 to the end, every step once."""
    from mmjax.models.config import EncoderSpec, MLLMConfig, ProjectorConfig
    from mmjax.models.tiny import TINY_LLM, TINY_VISION
    from mmjax.train.trainer import TrainingStopped, train

    cfg = MLLMConfig("tiny_guard", dataclasses.replace(TINY_LLM, num_layers=1, hidden_size=32,
                                                       ffn_size=64),
                     encoders=(EncoderSpec("vision", dataclasses.replace(
                         TINY_VISION, num_layers=1, hidden_size=16, ffn_size=32),
                         ProjectorConfig(downsample=1)),))
    work = str(tmp_path / "run")
    # the settings table refuses a peak_lr above 10 (a user's typo); this test needs one
    # that overflows the update, so it widens that one entry for itself
    from mmjax import settings
    monkeypatch.setitem(settings.SETTINGS["learning_rate_schedule"], "peak_lr",
                        settings._float(1e-3, 0, 1e31, open_lo=True))

    def run(lr, **kw):
        gin.clear_config()
        import mmjax.data.loader  # noqa: F401  (registers Loader with gin)

        # seq_len 64 rejects about half the synthetic samples (too long, counted as bad):
        # draw enough candidates and let more than half of them go
        gin.parse_config(["data_layout.seq_len = 64", "data_layout.vision_caps = (64,)",
                          "Loader.reserve = 16", "Loader.max_bad_fraction = 0.9",
                          f"learning_rate_schedule.peak_lr = {lr}",
                          "learning_rate_schedule.warmup_steps = 0"])
        try:
            return train(work, model=cfg, steps=6, global_batch=4, progress=False,
                         checkpoint_every=2, max_bad_steps=2, keep_checkpoints=1, **kw)
        finally:
            gin.clear_config()

    run(1e-3, stop_after=2)
    with pytest.raises(TrainingStopped, match=r"2 steps in a row \(\d\.\.\d\) had a non-finite "
                                              r".*Last good checkpoint: step 2 in "):
        run(1e30)
    assert sorted(os.listdir(os.path.join(work, "checkpoints"))) == ["2"]
    rows = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl"))]
    assert rows[-1]["nonfinite_steps"] == 2 and not np.isfinite(rows[-1]["loss"])
    recs = run(1e-3)
    assert [r["step"] for r in recs] == [3, 4, 5, 6]
    rows = [json.loads(x) for x in open(os.path.join(work, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert all(np.isfinite(r["loss"]) and r["nonfinite_steps"] == 0 for r in rows)


class ManyLeaves(nnx.Module):
    """`n` separate parameter leaves (a model's weights, as the optimizer sees them)."""

    def __init__(self, n: int):
        self.ws = nnx.List([nnx.Param(jnp.full((3,), 0.5 + i)) for i in range(n)])

    def __call__(self, batch, dtype, attention_impl="auto", llm_mask_family="bam"):
        loss = sum(jnp.sum(jnp.square(w[...] * batch["x"])) for w in self.ws)
        return loss, {"lm_loss": loss, "diffusion_loss": jnp.zeros(())}


@pytest.mark.parametrize("n", [40, 80])
def test_the_guard_flag_is_computed_once_not_per_leaf(n):
    """The step's compiled HLO stays linear in the leaves: were the guard's and-chain over
    every leaf's finiteness fused into each leaf's select, it would hold ~n^2 `and`s (the
    tiny model's step grew to 21 MB of HLO and 38 s of compile that way)."""
    graphdef, trainable, frozen = split_model(ManyLeaves(n), nnx.Param)
    tx = optax.adam(0.1)
    state = whole_model_state(trainable, tx.init(trainable), jnp.zeros((), jnp.int32))
    hlo = make_train_step(graphdef, tx).lower(state, frozen,
                                              {"x": jnp.ones(3)}).compile().as_text()
    ands = hlo.count(" and(")
    assert ands < 8 * n, (n, ands)


def test_a_finite_spike_above_the_limits_is_held_back_on_device(sqrt_step):
    """The loss-spike guard's limits (train/spike_guard.py) go into the step: a loss or a
    gradient norm above them leaves parameters and optimizer state as they were."""
    step, init = sqrt_step[0.1]
    x = {"x": jnp.ones(4, jnp.float32)}  # loss = 4 * sqrt(2) = 5.66
    for limits, spike in (((5.0, np.inf), 1.0), ((np.inf, 0.1), 1.0), ((6.0, 10.0), 0.0),
                          ((np.inf, np.inf), 0.0)):
        state = init()
        before = _copy(state)
        state, m = step(state, x, jnp.asarray(limits, jnp.float32))
        assert float(m["spike"]) == spike and float(m["nonfinite"]) == 0.0, limits
        assert int(state.step) == (0 if spike else 1) and bool(m["applied"]) == (not spike)
        same = all(np.array_equal(a, b) for a, b in zip(before, _copy(state)))
        assert same == bool(spike), limits
    ok = _fold_loss(jnp.float32(3.0), [jnp.float32(1.5), jnp.float32(2.0)], 4.0, 5.0)
    assert float(ok) == 3.0
    assert np.isnan(float(_fold_loss(jnp.float32(3.0), [jnp.float32(1.5),
                                                         jnp.float32(2.0)], 3.0, 5.0)))
    assert np.isnan(float(_fold_loss(jnp.float32(3.0), [jnp.float32(1.0)], 4.0, 2.9)))


def test_spike_guard_limits_are_factor_times_running_medians_and_survive_a_resume():
    from mmjax.train.spike_guard import SpikeGuard

    g = SpikeGuard(10.0, 6)
    assert g.limits() == (1e6, 1e8)  # before any applied step: the absolute limits
    g.add(4.0, 1.0)
    assert g.limits() == (40.0, 10.0)  # until half the window is filled: 10 x the largest
    g.add(3.0, 2.0)
    assert g.limits() == (40.0, 20.0)
    g.add(2.0, 4.0)
    assert g.limits() == (30.0, 20.0)
    for k in range(10):
        g.add(1.0 + k, 0.5)
    assert len(g.history) == 6 and g.limits() == (10 * 7.5, 10 * 0.5)
    again = SpikeGuard(10.0, 6)
    again.restore(json.loads(json.dumps(g.state())))  # through the checkpoint's JSON
    assert again.limits() == g.limits()
    assert SpikeGuard(0.0, 6).limits() == (np.inf, np.inf)
    big = SpikeGuard(100.0, 20)
    big.add(5e4, 1e7)
    assert big.limits() == (1e6, 1e8)  # never above the absolute limits


def test_a_huge_finite_loss_in_the_first_steps_is_held_back_by_default():
    """Issue 43: with the defaults (factor 100, window 20) a finite 1e22 loss at step 1 or
    at step 5 is above the limit the step is given (it was inf for 10 steps)."""
    from mmjax.train.run_spec import RunSpec
    from mmjax.train.spike_guard import SpikeGuard

    defaults = RunSpec()  # the run's defaults: train.spike_factor / train.spike_window
    g = SpikeGuard(defaults.spike_factor, defaults.spike_window)
    assert 1e22 > g.limits()[0]
    for loss in (10.4, 9.8, 9.1, 8.7):
        g.add(loss, 3.0)
    assert g.limits() == (1040.0, 300.0) and 1e22 > g.limits()[0]


def test_a_checkpoint_due_in_a_bad_streak_is_written_at_the_first_good_step():
    from mmjax.train.trainer import checkpoint_now

    owed, saved = False, []
    # checkpoint every 2; steps 3..5 bad (a streak over step 4), steps 6.. good again
    for n, bad in zip(range(1, 9), [0, 0, 1, 2, 3, 0, 0, 0]):
        save, owed = checkpoint_now(n % 2 == 0, bad, owed)
        saved += [n] if save else []
    assert saved == [2, 6, 8]  # step 4's checkpoint was written at step 6, not lost
    assert checkpoint_now(False, 0, False) == (False, False)
    assert checkpoint_now(True, 1, False) == (False, True)
    assert checkpoint_now(False, 0, True) == (True, False)
