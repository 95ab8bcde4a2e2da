"""The runtime's tracing modes (pipeline/trace.py): one record per dispatched action, per
mesh in schedule order and never overlapping itself; "overlap" keeps the dispatch loop
free of host syncs; tracing changes no number."""
import threading

import jax
import numpy as np
import pytest

from mmjax.data.feed import microbatch_feed
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.schedule.stage_graph import StageId
from mmjax.pipeline.trace import trace_mode
from mmjax.planner.plan import Plan
from helpers import global_batch, make_cfg

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    "timeline", os.path.join(os.path.dirname(__file__), "..", "scripts", "timeline.py"))
timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timeline)


@pytest.fixture(scope="module")
def setup():
    cfg = make_cfg(**{"llm.num_layers": 4})
    plan = Plan.uniform(cfg, 8, 4, dp={"vision": 2}, pp={"llm": 2}, num_chunks={"llm": 2})
    lay, samples = global_batch(cfg, 8)
    rt = PipelineRuntime(cfg, plan)
    dp = {u.name: u.dp for u in plan.units}
    feeds = [microbatch_feed(samples[m * 2:(m + 1) * 2], lay, dp) for m in range(4)]
    return plan, rt, feeds


def _grads(res):
    return [np.asarray(x) for sid in sorted(res.grads, key=str)
            for x in jax.tree.leaves(res.grads[sid])]


def _check_trace(plan, rt, trace):
    timeline.check_trace(trace)
    phys = [(str(StageId(s.unit, s.index % plan.unit(s.unit).pp)), a.kind, a.microbatch,
             a.chunk, str(s)) for s, a in rt.order]
    assert [(d["stage"], d["kind"], d["microbatch"], d["chunk"], d["virtual_stage"])
            for d in trace] == phys
    for stage in {d["stage"] for d in trace}:
        rows = [d for d in trace if d["stage"] == stage]
        for a, b in zip(rows, rows[1:]):
            assert a["start"] <= a["end"] <= b["start"] <= b["end"], (stage, a, b)


@pytest.mark.slow
def test_trace_modes_record_every_action_and_change_nothing(setup, monkeypatch):
    plan, rt, feeds = setup
    params = rt.initial_compute_params()
    base = rt.run(feeds, params)
    base_loss, base_grads = base.losses(), _grads(base)
    assert base.trace == []

    serial = rt.run(feeds, params, trace=True)
    _check_trace(plan, rt, serial.trace)
    assert serial.losses() == base_loss
    for a, b in zip(_grads(serial), base_grads, strict=True):
        np.testing.assert_array_equal(a, b)

    main = threading.main_thread()
    real_wait = jax.block_until_ready

    def wait_off_main_thread(x):
        if threading.current_thread() is main:
            raise AssertionError("host sync on the dispatch thread")
        return real_wait(x)

    with monkeypatch.context() as mp:  # overlap: only the waiter threads block
        mp.setattr(jax, "block_until_ready", wait_off_main_thread)
        overlap = rt.run(feeds, params, trace="overlap")
        with pytest.raises(AssertionError, match="dispatch thread"):  # the trap is armed
            jax.block_until_ready(overlap.lm_loss)
    _check_trace(plan, rt, overlap.trace)
    assert overlap.losses() == base_loss
    for a, b in zip(_grads(overlap), base_grads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_trace_mode_names():
    assert trace_mode(False) is None and trace_mode(True) == "serial"
    assert trace_mode("overlap") == "overlap"
    with pytest.raises(ValueError, match="trace='async'"):
        trace_mode("async")
