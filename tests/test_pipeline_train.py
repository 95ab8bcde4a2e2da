"""Training steps on the pipeline runtime equal the single-program optimizer (ZeRO-1, shared
global-norm clipping), and the pipelined trainer resumes exactly."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmjax.data.assemble import assemble
from mmjax.data.batch_shapes import batch_shapes
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.data.feed import microbatch_feed
from reference_layout import to_reference_layout
from mmjax.planner.plan import Plan
from mmjax.train.inputs import model_inputs
from mmjax.train.optimizer import OptimizerSettings, optimizer_from_settings
from mmjax.train.pipelined import PipelinedRunner
from mmjax.train.state import WHOLE_MODEL, whole_model_state
from mmjax.train.step import make_train_step, split_model

from helpers import global_batch, make_cfg, plan_feeds

# eps large enough that gradients which are zero in exact arithmetic (attention key biases:
# float noise ~1e-10) give no Adam update; clip_norm small so clipping is active.
SETTINGS = OptimizerSettings(weight_decay=0.1, clip_norm=0.5, eps=1e-3)


def test_two_pipelined_steps_equal_single_program_steps():
    cfg = make_cfg(**{"encoders.vision.frozen": True})
    lay, samples = global_batch(cfg, 8)
    batches = [samples[:4], samples[4:]]  # two global batches of 4
    schedule = 1e-2

    mdl = MultimodalModel(cfg, jax.random.key(0))
    gd, tr, fr = split_model(mdl, trainable_filter(cfg))
    flat = lambda t: {jax.tree_util.keystr(p): np.array(v)  # copies: steps may donate
                      for p, v in jax.tree_util.tree_flatten_with_path(t)[0]}
    ref_frozen0 = flat(nnx.to_pure_dict(fr))  # the reference's initial frozen parameters
    tx = optimizer_from_settings(schedule, SETTINGS)
    state = whole_model_state(tr, tx.init(tr), jnp.zeros((), jnp.int32))
    step = make_train_step(gd, tx)
    ref_losses = []
    # both batches at one static shape: the single program compiles once
    shapes = batch_shapes([[lay.rules.meta(s) for s in b] for b in batches], lay)
    for b in batches:
        state, m = step(state, fr, model_inputs(assemble(b, lay, shapes)))
        ref_losses.append(float(m["loss"]))

    plan = Plan.uniform(cfg, 4, 2, dp={"vision": 2, "llm": 1, "generator": 2}, tp={"llm": 2},
                        pp={"llm": 2})
    ps = PipelinedRunner(cfg, plan, schedule, settings=SETTINGS)
    feeds = plan_feeds(plan, lay, samples)  # both steps' feeds, one shape floor
    losses = [ps.train_on(feeds[:2]).loss, ps.train_on(feeds[2:]).loss]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)

    got = to_reference_layout(plan, {sid: nnx.to_pure_dict(ps.state.stages[sid].master)
                                     for sid in ps.optimizers})
    ref = nnx.to_pure_dict(state.stages[WHOLE_MODEL].master)
    g, r = flat(got), flat(ref)
    assert set(g) == set(r)
    assert not any("encoders" in k for k in g)  # frozen encoder: no optimizer, no update
    for k in r:
        np.testing.assert_allclose(g[k], r[k], rtol=1e-4, atol=2e-6, err_msg=k)
    # frozen parameters after the steps, gathered from every stage into the reference
    # layout, are bit-identical to the reference model's initial frozen parameters
    frozen = flat(to_reference_layout(plan, {sid: nnx.to_pure_dict(st.frozen)
                                             for sid, st in ps.runtime.stages.items()}))
    assert any("encoders" in k for k in ref_frozen0)  # the frozen vision encoder
    for (k, a), (k2, b) in zip(sorted(ref_frozen0.items()), sorted(frozen.items()),
                               strict=True):
        assert k == k2
        np.testing.assert_array_equal(b, a, err_msg=k)
    vision = ps.runtime.stages[list(ps.runtime.stages)[0]]
    assert vision.mode == "params"  # trainable projector, frozen encoder: no input gradient
    assert any("projectors" in k for k in g)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_pipelined_cli_resumes_exactly(tmp_path):
    args = [sys.executable, os.path.join(REPO, "scripts", "train.py"), "--plan=manual",
            '--gin_param=manual_plan.dp={"vision": 2}', '--gin_param=manual_plan.pp={"llm": 2}',
            '--gin_param=named_model_config.overrides={"llm.num_layers": 2}',
            "--gin_param=train.steps=3", "--gin_param=train.progress=False",
            "--gin_param=train.checkpoint_every=1"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = lambda *extra: subprocess.run([*args, *extra], cwd=REPO, env=env, capture_output=True,
                                        text=True, timeout=600)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    for p in (run(f"--workdir={a}"), run(f"--workdir={b}", "--gin_param=train.stop_after=1"),
              run(f"--workdir={b}")):
        assert p.returncode == 0, p.stderr[-3000:]
    recs = lambda d: [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    ra, rb = recs(a), recs(b)
    assert [r["step"] for r in rb] == [1, 2, 3]
    for r in ra:  # the packing's fill: real tokens / the LLM slots of every microbatch's feed
        assert 0 < r["llm_fill"] <= 1
        assert r["llm_fill"] == pytest.approx(r["tokens_seen"] / r["llm_slots"])
    # bit-exact, as the README promises: every metric but the host's clock readings
    clock = lambda k: "time" in k or k.endswith("_s") or "per_s" in k
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if not clock(k)} == {
            k: v for k, v in y.items() if not clock(k)}, (x, y)


@pytest.mark.slow
def test_pipeline_state_round_trip_is_exact(tmp_path):
    """Checkpoint a pipelined run after one step, restore into a fresh runtime: every
    parameter and optimizer leaf is bit-identical and the next steps agree exactly."""
    from mmjax.train.checkpoint import Checkpointer

    cfg = make_cfg()
    lay, samples = global_batch(cfg, 4)
    plan = Plan.uniform(cfg, 4, 2, dp={"vision": 2}, pp={"llm": 2})
    dp = {u.name: u.dp for u in plan.units}
    feeds = [microbatch_feed(samples[m * 2:(m + 1) * 2], lay, dp) for m in range(2)]
    a = PipelinedRunner(cfg, plan, 1e-2)
    a.train_on(feeds)
    ck = Checkpointer(str(tmp_path / "ck"))
    ck.save(1, a.checkpoint()[0], {"note": "x"})
    ck.wait()
    b = PipelinedRunner(cfg, plan, 1e-2)
    state, data = ck.restore(1, b.restore_target())
    b.load(state, data, 1)
    assert data == {"note": "x"}
    for x, y in zip(jax.tree.leaves(a.checkpoint()[0]), jax.tree.leaves(b.checkpoint()[0])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert a.train_on(feeds).loss == b.train_on(feeds).loss
    ck.close()
