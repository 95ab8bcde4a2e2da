"""Tied embeddings under pp > 1 (Megatron's embedding group): the first and last LLM stage
each hold the embedding; the runtime sums their gradients, which then equal the single
model's embedding gradient."""
import numpy as np
import pytest
from helpers import assert_same_grads, assert_same_loss, cached_reference, make_cfg

from mmjax.data.feed import microbatch_feed
from reference_layout import pure_grads, to_reference_layout
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config


@pytest.mark.slow
def test_tied_llm_pp2_matches_single_device():
    cfg = make_cfg(**{"llm.tie_embeddings": True, "generator": None})
    plan = Plan.uniform(cfg, 4, 2, pp={"llm": 2})
    lay, samples, ref_loss, ref_grads = cached_reference(None, cfg, 4)
    rt = PipelineRuntime(cfg, plan)
    res = rt.run([microbatch_feed(samples[m * 2:(m + 1) * 2], lay, {"vision": 1, "llm": 1})
                  for m in range(2)], rt.initial_compute_params())
    grads = pure_grads(res)
    first, last = rt.tied_embedding_stages()
    # both copies get the sum, so they step alike
    np.testing.assert_array_equal(np.asarray(grads[first]["embed"]),
                                  np.asarray(grads[last]["embed"]))
    assert_same_loss(res.losses()["loss"], ref_loss)
    assert_same_grads(to_reference_layout(plan, grads), ref_grads)  # embedding's included
