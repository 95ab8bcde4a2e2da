"""The LLM's mask family follows the data layout: text-only rows of one sample each are plain
causal (so "auto" may run cuDNN on a GPU, Cornstarch's bitfield mask being needed only with
modality tokens or packed documents), and every LLM attention site passes it on."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import make_cfg
from mmjax.errors import UserError
from mmjax.data.layout import AssemblyLayout
from mmjax.data.assemble import assemble
from mmjax.data.feed import microbatch_feed
from mmjax.data.sample import Sample, Segment
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.pipeline.stage import make_stage_fns
from mmjax.planner.plan import Plan
from mmjax.train.inputs import model_inputs
from mmjax.train.step import make_loss_fn, split_model

TEXT_ONLY = {"encoders": (), "generator": None}


def _text_samples(n):
    return [Sample(i, (Segment("text", 16 + np.arange(5 + i, dtype=np.int32) % 50),))
            for i in range(n)]


def test_layout_mask_family():
    text = make_cfg(**TEXT_ONLY)
    assert AssemblyLayout.from_config(text, 32, "pad").llm_mask_family == "causal"
    assert AssemblyLayout.from_config(text, 32, "pack").llm_mask_family == "bam"
    assert AssemblyLayout.from_config(make_cfg(), 32, "pad").llm_mask_family == "bam"


@pytest.mark.parametrize("family,message", [("causal", "needs a GPU"),
                                            ("bam", "only plain causal or full")])
def test_the_single_program_llm_declares_its_mask_family(family, message):
    cfg = make_cfg(**TEXT_ONLY)
    lay = AssemblyLayout.from_config(cfg, 32, "pad")
    gd, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(0)), trainable_filter(cfg))
    loss = make_loss_fn(gd, jnp.float32, "cudnn", family)
    batch = assemble(_text_samples(4), lay)
    assert not batch.skipped and batch.num_target_tokens > 0
    with pytest.raises(UserError, match=message):  # raised while tracing: nothing compiles
        jax.jit(loss)(tr, fr, model_inputs(batch))


@pytest.mark.parametrize("family,message", [("causal", "needs a GPU"),
                                            ("bam", "only plain causal or full")])
def test_pipeline_llm_stages_declare_their_mask_family(family, message):
    cfg = make_cfg(**TEXT_ONLY)
    lay = AssemblyLayout.from_config(cfg, 32, "pad")
    rt = PipelineRuntime(cfg, Plan.uniform(cfg, 4, 1), llm_mask_family=family)
    sid, st = next(iter(rt.stages.items()))
    up = dataclasses.replace(rt.plan.unit("llm"), attention_impl="cudnn")  # Plans refuse it
    feed = microbatch_feed(_text_samples(4), lay, {"llm": 1})
    side = rt.transfers.side(sid, feed, (feed.num_target_tokens, 0))
    assert st.fns.apply(rt.initial_compute_params()[sid], st.frozen, None, side).shape == (1,)  # auto: runs
    with pytest.raises(UserError, match=message):
        make_stage_fns(cfg, up, st.graphdef, st.mode, jnp.float32, st.mesh,
                       llm_mask_family=family)
