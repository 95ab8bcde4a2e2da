"""Balancing and reordering on a real LLaVA-format set: the loader plans from the sidecar
index only (image sizes from file headers, token counts from the tokenizer, assistant-only
loss masks), and the pipeline runtime then gives the single-device loss and gradients of the
same global batch (OrchMLLM §5 post-balancing, DistTrain §6 reordering).

Mixed set: images of very different sizes (3x3 to 8x8 patches, one sample with two images)
and text-only samples; a missing and a corrupt image are skipped by the planner. Plan on 6
CPU devices: vision dp2, LLM dp2 x pp2; 8 samples in 2 microbatches.
"""
import pytest

from mmjax.data.layout import AssemblyLayout
from mmjax.data.example_data import write_llava_example
from mmjax.data.loader import Loader
from mmjax.data.batch_plan import unit_policies
from mmjax.data.sources import default_processors
from mmjax.data.sources.llava import LlavaSource
from mmjax.data.tokenizer import Tokenizer, padded_vocab
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan

from helpers import assert_same_grads, assert_same_loss, make_cfg, reference

STEP = 1
pytestmark = [pytest.mark.slow, pytest.mark.parity]  # three runtime compiles plus the reference: ~60 s on 2 cores


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    info = write_llava_example(str(tmp_path_factory.mktemp("llava")), num_samples=40)
    tok = Tokenizer(info["tokenizer"])
    cfg = make_cfg(**{"encoders.vision.encoder.max_grid": 8, "generator": None,
                      "llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                      "llm.vocab_size": padded_vocab(tok.vocab_size)})
    lay = AssemblyLayout.from_config(cfg, 192, "pad", vision_caps=(128,),
                                     special=tok.special_tokens())
    img, aud = default_processors(cfg, None, None)
    src = LlavaSource(info["json"], tok, img, aud, info["image_root"], index_workers=2)
    plan = Plan.uniform(cfg, 8, 2, dp={"vision": 2, "llm": 2}, pp={"llm": 2})
    idx = Loader.build(src, cfg, plan, lay, unit_policies("none", cfg), seed=1,
                             reserve=8).stream.select(STEP)[0]
    samples = [src.load(i) for i in idx]
    ref_loss, ref_grads = reference(cfg, lay, samples)
    return cfg, lay, src, plan, idx, samples, ref_loss, ref_grads


def test_the_batch_is_mixed(setup):
    cfg, lay, src, plan, idx, samples, *_ = setup
    patches = [s.data.shape[0] * s.data.shape[1] // 16 for x in samples for s in x.segments
               if s.modality == "image"]
    assert max(patches) >= 2 * min(patches)  # very different image sizes
    assert any(all(s.modality == "text" for s in x.segments) for x in samples)  # text-only
    assert all(any(s.loss_mask is not None and not s.loss_mask.all() for s in x.segments)
               for x in samples)  # prompts masked: loss on assistant turns only


@pytest.mark.parametrize("balance", ["orchmllm", "disttrain"])
def test_llava_plans_on_the_runtime_match_the_reference(setup, balance):
    cfg, lay, src, plan, idx, samples, ref_loss, ref_grads = setup
    builder = Loader.build(src, cfg, plan, lay, unit_policies(balance, cfg), seed=1,
                                 reserve=8, cp_block=16).builder
    gb = builder(STEP)
    assert gb.sample_ids == idx and gb.decode_failures == 0
    mps = [mb.plan for mb in gb.microbatches]
    size = plan.microbatch_size
    contiguous = [[list(mp.positions[r * size // 2:(r + 1) * size // 2]) for r in range(2)]
                  for mp in mps]
    assert any(mp.ranks["vision"] != c or mp.ranks["llm"] != c for mp, c in zip(mps, contiguous))
    rt = PipelineRuntime(cfg, plan)
    res = rt.run([mb.feed for mb in gb.microbatches], rt.initial_compute_params())
    grads = to_reference_layout(plan, pure_grads(res))
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(grads, ref_grads)
