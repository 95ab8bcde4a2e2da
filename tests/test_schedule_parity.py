"""Every schedule by name (`train.schedule`) trains the single program's model.

A pipelined plan run under "1f1b" and under "gpipe" gives the reference loss and gradients
(the tolerance rule of tests/helpers.py), and the two give the same numbers as each other:
both run the same stage programs and every stage adds its microbatches' gradients in the
same order (each row's backwards in microbatch order), so they agree bit for bit. The
interleaved schedule's parity (virtual stages) runs in the slow pass.
"""
import jax
import numpy as np
import pytest

from helpers import (assert_same_grads, assert_same_loss, cached_reference, check, make_cfg,
                     run_plan)
from mmjax.errors import UserError
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.planner.plan import Plan
from mmjax.schedule.named import multimodal_gpipe

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def runs(reference_cache):
    """{schedule: (runtime, loss, grads)} of one plan (LLM over 2 stages, 2 microbatches)
    and the reference (loss, grads)."""
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, pp={"llm": 2})
    lay, samples, ref_loss, ref_grads = cached_reference(reference_cache, cfg, 4)
    return ({name: run_plan(cfg, plan, lay, samples, schedule=name)
             for name in ("1f1b", "gpipe")}, (ref_loss, ref_grads))


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_schedule_gives_the_reference(runs, name):
    (_, loss, grads), (ref_loss, ref_grads) = runs[0][name], runs[1]
    assert_same_loss(loss, ref_loss)
    assert_same_grads(grads, ref_grads)


def test_gpipe_and_1f1b_agree_bit_for_bit(runs):
    (_, loss_a, grads_a), (_, loss_b, grads_b) = runs[0]["1f1b"], runs[0]["gpipe"]
    assert loss_a == loss_b
    flat_a, flat_b = jax.tree_util.tree_leaves_with_path(grads_a), jax.tree.leaves(grads_b)
    assert len(flat_a) == len(flat_b)
    for (path, a), b in zip(flat_a, flat_b):
        assert np.array_equal(np.asarray(a), np.asarray(b)), jax.tree_util.keystr(path)


def test_gpipe_runtime_dispatches_gpipe_rows(runs):
    """Each mesh runs its GPipe row: the runtime's order projected onto a stage."""
    rt = runs[0]["gpipe"][0]
    assert rt.schedule == multimodal_gpipe(rt.graph, 2)
    for sid in rt.graph.physical_stages:
        assert [a for s, a in rt.order if s == sid] == rt.schedule[sid]
    first_b = min(i for i, (_, a) in enumerate(rt.order) if a.kind == "B")
    assert all(a.kind == "B" for _, a in rt.order[first_b:])


def test_interleaved_refuses_a_plan_without_virtual_stages():
    cfg = make_cfg()
    with pytest.raises(UserError, match="train.schedule='interleaved' needs virtual stages"):
        PipelineRuntime(cfg, Plan.uniform(cfg, 4, 2, pp={"llm": 2}), schedule="interleaved")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["interleaved", "gpipe"])
def test_virtual_stages_under_each_schedule(name, reference_cache):
    cfg = make_cfg()
    plan = Plan.uniform(cfg, 4, 2, pp={"llm": 2}, num_chunks={"llm": 2})
    check(cfg, plan, n=4, cache=reference_cache, schedule=name)
