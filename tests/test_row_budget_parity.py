"""The parity invariant under `Loader.row_budget` (data/row_budget.py): a global batch of a
variable number of samples, packed first fit decreasing into a fixed number of rows and
planned over 3 microbatches (OrchMLLM §5.1 post-balancing per phase; vision dp2, LLM dp2 x
pp2, generator dp1), gives on the pipeline runtime the single-device loss and gradients of
the same samples (tolerances: test_runtime_parity's float64 rule)."""
import pytest

from mmjax.data.batch_plan import unit_policies
from mmjax.data.batch_shapes import pack_rows
from mmjax.data.loader import Loader
from mmjax.data.layout import AssemblyLayout
from mmjax.data.records import SyntheticSource
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan
from reference_layout import pure_grads, to_reference_layout

from helpers import assert_same_grads, assert_same_loss, make_cfg, reference

pytestmark = pytest.mark.parity


@pytest.mark.slow  # one more runtime compile (~40 s on 2 cores)
def test_row_budget_batches_keep_parity():
    cfg = make_cfg()
    lay = AssemblyLayout.from_config(cfg, 160, "pack", vision_caps=(64, 256),
                                     audio_frame_caps=(128, 256, 512))
    src = SyntheticSource(SyntheticDataset("laion", SyntheticConfig.for_model(
        cfg, gen_fraction=0.5, frames_median=60.0), seed=3, size=200))
    plan = Plan.uniform(cfg, 12, 3, dp={"vision": 2, "llm": 2, "generator": 1}, pp={"llm": 2})
    builder = Loader.build(src, cfg, plan, lay, unit_policies("orchmllm", cfg), seed=1,
                                 reserve=8, cp_block=16, row_budget=6).builder
    gb = builder(2)
    metas = [lay.rules.meta(src.load(i)) for i in gb.sample_ids]
    assert len(gb.sample_ids) % 3 == 0 and len(gb.sample_ids) != 12
    assert max(pack_rows([m.llm_length for m in metas], 160, "pack")) + 1 <= 6
    ref_loss, ref_grads = reference(cfg, lay, [src.load(i) for i in gb.sample_ids])
    rt = PipelineRuntime(cfg, plan)
    res = rt.run([mb.feed for mb in gb.microbatches], rt.initial_compute_params())
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(to_reference_layout(plan, pure_grads(res)), ref_grads)
