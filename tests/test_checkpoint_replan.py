"""Plan-independent checkpoints (train/logical_state.py): a run checkpointed under plan A
continues under plan B (other dp, tp, pp) or as one program, with the losses of the
uninterrupted plan-A run up to float reassociation (the parity tests' 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import global_batch, make_cfg
from mmjax.data.assemble import assemble
from mmjax.data.feed import microbatch_feed
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.planner.plan import Plan
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.inputs import model_inputs
from mmjax.train.logical_state import single_from_logical, single_logical
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.pipelined import PipelinedRunner
from mmjax.train.state import whole_model_state
from mmjax.train.step import make_train_step, split_model

SETTINGS = OptimizerSettings(weight_decay=0.1, clip_norm=0.5, eps=1e-3)  # as test_pipeline_train
LR = 1e-2


def _feeds(plan, lay, batch):
    dp = {u.name: u.dp for u in plan.units}
    m = plan.num_microbatches
    size = len(batch) // m
    return [microbatch_feed(batch[i * size:(i + 1) * size], lay, dp) for i in range(m)]


def _single(cfg):
    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    tx = optimizer_from_settings(LR, SETTINGS)
    return (whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32)), fr,
            make_train_step(gd, tx))


@pytest.mark.slow
def test_four_steps_on_plan_a_then_four_on_plan_b_or_one_program(tmp_path):
    cfg = make_cfg()
    lay, samples = global_batch(cfg, 8)
    batches = [samples[:4], samples[4:]]
    plan_a = Plan.uniform(cfg, 4, 2, dp={"vision": 2}, pp={"llm": 2})
    plan_b = Plan.uniform(cfg, 4, 2, dp={"vision": 1, "llm": 2, "generator": 2},
                          tp={"llm": 2})
    a = PipelinedRunner(cfg, plan_a, LR, settings=SETTINGS)
    ck = Checkpointer(str(tmp_path / "checkpoints"))
    straight = []
    for i in range(8):
        straight.append(a.train_on(_feeds(plan_a, lay, batches[i % 2])).loss)
        if i == 3:
            ck.save(4, a.checkpoint()[0], {"note": "plan A"})
    ck.wait()

    # the same names and logical shapes under every plan and in the single program
    b = PipelinedRunner(cfg, plan_b, LR, settings=SETTINGS)
    state, frozen, step_fn = _single(cfg)
    shapes = lambda named: {k: (tuple(v.shape), str(v.dtype)) for k, v in named.items()}
    assert shapes(b.checkpoint()[0]) == shapes(a.checkpoint()[0])
    assert shapes(single_logical(state)) == shapes(a.checkpoint()[0])
    names = set(single_logical(state))
    assert "opt.count" in names and any(k.startswith("params.llm.layers.3.") for k in names)
    assert {"opt.mu." + k[len("params."):] for k in names if k.startswith("params.")} < names

    step, restored, data = ck.restore_latest(b.restore_target())
    assert step == 4 and data == {"note": "plan A"}
    b.load(restored, data, step)
    resumed = [b.train_on(_feeds(plan_b, lay, batches[i % 2])).loss for i in range(4, 8)]
    np.testing.assert_allclose(resumed, straight[4:], rtol=1e-5)

    _, restored, _ = Checkpointer(str(tmp_path / "checkpoints")).restore_latest(
        single_logical(state))
    state = single_from_logical(state, restored)
    assert int(state.step) == 4
    single = []
    for i in range(4, 8):
        state, m = step_fn(state, frozen, model_inputs(assemble(batches[i % 2], lay)))
        single.append(float(m["loss"]))
    np.testing.assert_allclose(single, straight[4:], rtol=1e-5)
    ck.close()
