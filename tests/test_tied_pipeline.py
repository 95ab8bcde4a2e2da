"""Tied embeddings under pp > 1 (Megatron's embedding group): the first and last LLM stage
each hold the embedding; the runtime sums their gradients, which then equal the single
model's embedding gradient."""
import numpy as np
import pytest
from flax import nnx
from test_runtime_parity import check, make_cfg

from mmjax.planner.plan import Plan


@pytest.mark.slow
def test_tied_llm_pp2_matches_single_device():
    cfg = make_cfg(**{"llm.tie_embeddings": True, "generator": None})
    plan = Plan.uniform(cfg, 4, 2, pp={"llm": 2})
    rt = check(cfg, plan, n=4)  # loss and every gradient, the embedding's included
    first, last = rt.tied_embedding_stages()
    a = nnx.to_pure_dict(rt.stages[first].grads)["embed"]
    b = nnx.to_pure_dict(rt.stages[last].grads)["embed"]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # both copies step alike
