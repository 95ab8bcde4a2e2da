"""The parity invariant through the data path: global batches planned by the loader
(OrchMLLM post-balancing per phase, OrchMLLM §5; DistTrain intra- and inter-microbatch
reordering, DistTrain §6) and run by the pipeline runtime give the single-device loss and
gradients of the same global batch.

Plan on 8 CPU devices with a different dp per unit: vision dp2, LLM dp2 x pp2, generator
dp1 (7 devices); 12 samples in 3 microbatches. The reference is computed once (the global batch's samples do not depend
on the balancing policy); tolerances and the gradient check are test_runtime_parity's.
"""
import pytest

from mmjax.data.layout import AssemblyLayout
from mmjax.data.loader import Loader
from mmjax.data.records import SyntheticSource
from mmjax.data.batch_plan import unit_policies
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan

from helpers import assert_same_grads, assert_same_loss, make_cfg, reference

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config

STEP = 3  # a global batch whose microbatches the DistTrain plan reorders (asserted below)


@pytest.fixture(scope="module")
def setup():
    cfg = make_cfg()
    lay = AssemblyLayout.from_config(cfg, 160, "pad", vision_caps=(64, 256),
                                     audio_frame_caps=(128, 256, 512))
    src = SyntheticSource(SyntheticDataset("laion", SyntheticConfig.for_model(
        cfg, gen_fraction=0.5, frames_median=60.0), seed=3, size=200))
    plan = Plan.uniform(cfg, 12, 3, dp={"vision": 2, "llm": 2, "generator": 1}, pp={"llm": 2})
    idx = Loader.build(src, cfg, plan, lay, unit_policies("none", cfg), seed=1,
                             reserve=8).stream.select(STEP)[0]
    ref_loss, ref_grads = reference(cfg, lay, [src.load(i) for i in idx])
    return cfg, lay, src, plan, idx, ref_loss, ref_grads


@pytest.fixture(scope="module")
def builders(setup):
    """Each policy's feed builder, padding to one shape floor (the union of both policies'
    scanned floors, as the loader pads a run's feeds): the stage programs compile once."""
    cfg, lay, src, plan = setup[:4]
    out = {b: Loader.build(src, cfg, plan, lay, unit_policies(b, cfg), seed=1,
                                 reserve=8, cp_block=16).builder
           for b in ("orchmllm", "disttrain")}
    floor = None
    for b in out.values():
        floor = b.scan_floor(STEP + 1).union(floor)
    for b in out.values():
        b.floor = floor
    return out


@pytest.fixture(scope="module")
def runtime(setup):
    """One runtime for both policies (it holds no training state; both policies' feeds
    have one shape floor): its stage programs are traced and compiled once."""
    cfg, plan = setup[0], setup[3]
    return PipelineRuntime(cfg, plan)


@pytest.mark.parametrize("balance", ["orchmllm", "disttrain"])
def test_loader_plans_on_the_runtime_match_the_reference(setup, builders, runtime, balance):
    cfg, lay, src, plan, idx, ref_loss, ref_grads = setup
    builder = builders[balance]
    gb = builder(STEP)
    assert gb.sample_ids == idx and gb.decode_failures == 0
    assert all(mb.feed.shapes == builder.floor for mb in gb.microbatches)
    mps = [mb.plan for mb in gb.microbatches]
    size = plan.microbatch_size
    # the balancers really moved samples: per-phase splits differ from contiguous ones,
    # and (DistTrain) Algorithm 3 changed the microbatch order
    contiguous = [[list(mp.positions[r * size // d:(r + 1) * size // d]) for r in range(d)]
                  for mp in mps for d in (2,)]
    assert any(mp.ranks["vision"] != c or mp.ranks["llm"] != c for mp, c in zip(mps, contiguous))
    if balance == "disttrain":
        assert [mp.positions[0] // size for mp in mps] != list(range(plan.num_microbatches))
    else:
        assert any(mp.ranks["vision"] != mp.ranks["llm"] for mp in mps)
    assert all(len(mp.ranks["generator"]) == 1 for mp in mps)

    res = runtime.run([mb.feed for mb in gb.microbatches], runtime.initial_compute_params())
    grads = to_reference_layout(plan, pure_grads(res))
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(grads, ref_grads)


@pytest.mark.slow
def test_feeds_padded_to_the_scanned_floor_keep_parity(setup):
    """Feeds padded to the shape floor of the first steps (Loader.shape_scan_steps): more
    rows, buffers and part slots, all empty, and the same loss and gradients."""
    cfg, lay, src, plan, idx, ref_loss, ref_grads = setup
    builder = Loader.build(src, cfg, plan, lay, unit_policies("orchmllm", cfg), seed=1,
                                 reserve=8, cp_block=16).builder
    own = [mb.feed.shapes for mb in builder(STEP).microbatches]
    builder.floor = builder.scan_floor(STEP + 4)
    feeds = [mb.feed for mb in builder(STEP).microbatches]
    assert all(f.shapes == builder.floor for f in feeds)  # every microbatch one shape
    assert any(f.shapes != o for f, o in zip(feeds, own))  # and padding happened
    rt = PipelineRuntime(cfg, plan)
    res = rt.run(feeds, rt.initial_compute_params())
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(to_reference_layout(plan, pure_grads(res)), ref_grads)

