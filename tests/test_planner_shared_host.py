"""planner/shared_host.py: a pipelined plan on one host's forced devices - the padded
shapes, dense attention at the measured time per pair, and the host's cores shared."""
from dataclasses import replace

import pytest

from mmjax.models.tiny import tiny
from mmjax.planner.costs import unit_costs
from mmjax.planner.evaluate import Choice
from mmjax.planner.hardware import H100
from mmjax.planner.schedule_time import schedule_time
from mmjax.planner.elementwise import elementwise_s
from mmjax.planner.shared_host import (dense_costs, padded_workload, schedule_actions,
                                       shared_host_time)
from mmjax.planner.step_model import dense_attention_s, unit_seconds
from mmjax.planner.workload import Workload

HW = replace(H100, dense_pair_s=2e-9, dense_pair_head_dim=16)
WL = Workload("w", (100, 180), {"vision": ((30, 64), (200,))}, (1, 0))


def test_padded_workload_is_the_pad_layouts_shapes():
    p = padded_workload(WL, 256, (64, 256))
    assert p.llm_tokens == (256, 256)
    assert p.encoder_tokens == {"vision": ((64, 64), (256,))}
    assert p.generated == WL.generated


def test_dense_costs_reprice_attention_per_pair_split_over_tp():
    model = tiny()
    wl = padded_workload(WL, 256, (64, 256))
    costs = unit_costs(model, wl, HW)
    dense = {c.name: c for c in dense_costs(model, wl, HW, costs, act_bytes=4)}
    before = {c.name: c for c in costs}
    llm = dense_attention_s(model, "llm", 256, HW) - unit_seconds(model, wl, HW, "llm",
                                                                   "none")[1]
    vision = ((2 * dense_attention_s(model, "vision", 64, HW)
               + dense_attention_s(model, "vision", 256, HW)) / 2
              - unit_seconds(model, wl, HW, "vision", "none")[1])
    # every unit also pays its elementwise passes (float32 activations here), split over tp
    for name, delta in (("llm", llm), ("vision", vision), ("generator", 0.0)):
        delta += elementwise_s(model, wl, name, HW, act_bytes=4)
        for tp, t in before[name].time_s.items():
            assert dense[name].time_s[tp] == pytest.approx(t + delta / tp)
    assert dense_costs(model, wl, replace(HW, dense_pair_s=0.0), costs) == costs


def test_shared_host_time_is_the_schedule_or_the_cores_whichever_is_longer():
    model = tiny()
    costs = unit_costs(model, WL, HW)
    choices = {"vision": Choice(1, 2, 1), "llm": Choice(2, 1, 2), "generator": Choice(1, 2, 1)}
    t = shared_host_time(costs, choices, 8, HW, cores=2, busy_cores=1.5)
    work = sum(8 * c.time_s[choices[c.name].tp] * choices[c.name].tp for c in costs)
    assert t.schedule_s == pytest.approx(schedule_time(costs, choices, 8, HW))
    assert t.compute_s == pytest.approx(work)
    assert t.cores_bound_s == pytest.approx(work * 1.5 / 2)
    assert t.step_s == max(t.schedule_s, t.cores_bound_s)
    assert t.host_s == 0.0 and t.cpu_s == t.compute_s  # no dispatch cost measured
    # a device cannot keep more cores busy than the host has
    assert shared_host_time(costs, choices, 8, HW, 2, 4.0).cores_bound_s == pytest.approx(work)


def test_dense_costs_under_full_remat_rerun_the_forward():
    """The runtime's stages default to "full" remat (Plan): the backward re-runs the
    forward, so the dense attention takes 4 passes of 3 and the elementwise passes 7
    accesses of 5, on top of `unit_costs` priced with the same policies."""
    model = tiny()
    wl = padded_workload(WL, 256, (64, 256))
    remat = {u: "full" for u in model.unit_names}
    costs = unit_costs(model, wl, HW, recompute=remat)
    dense = {c.name: c for c in dense_costs(model, wl, HW, costs, act_bytes=4, remat=remat)}
    before = {c.name: c for c in costs}
    llm = (dense_attention_s(model, "llm", 256, HW, remat="full")
           - unit_seconds(model, wl, HW, "llm", "full")[1]
           + elementwise_s(model, wl, "llm", HW, "full", act_bytes=4))
    assert dense_attention_s(model, "llm", 256, HW, remat="full") == pytest.approx(
        dense_attention_s(model, "llm", 256, HW) * 4 / 3)
    assert elementwise_s(model, wl, "llm", HW, "full", 4) == pytest.approx(
        elementwise_s(model, wl, "llm", HW, "none", 4) * 7 / 5)
    for tp, t in before["llm"].time_s.items():
        assert dense["llm"].time_s[tp] == pytest.approx(t + llm / tp)


def test_each_action_dispatched_costs_the_measured_host_cpu():
    """The runtime's thread dispatches a forward and a backward per microbatch on every
    stage (vision 1 + llm 2 + generator 1 = 4 stages x 4 microbatches x 2 = 32 actions, as
    bench_runtime.py counts them): each adds the probe's host CPU to the step's CPU and,
    on a core, to the shared cores' bound."""
    model = tiny()
    costs = unit_costs(model, WL, HW)
    choices = {"vision": Choice(1, 2, 1), "llm": Choice(2, 1, 2), "generator": Choice(1, 2, 1)}
    assert schedule_actions(choices, 4) == 32
    assert schedule_actions({**choices, "llm": Choice(2, 1, 2, vpp=2)}, 4) == 48
    base = shared_host_time(costs, choices, 8, HW, cores=2, busy_cores=1.5)
    t = shared_host_time(costs, choices, 8, HW, 2, 1.5, action_host_s=3e-3, num_microbatches=4)
    assert t.num_actions == 32 and t.host_s == pytest.approx(32 * 3e-3)
    assert t.cpu_s == pytest.approx(base.compute_s + 32 * 3e-3)
    assert t.cores_bound_s == pytest.approx(base.cores_bound_s + 32 * 3e-3 / 2)
    assert t.schedule_s == base.schedule_s
    assert t.step_s == max(t.schedule_s, t.cores_bound_s, t.host_s)
    # without the runtime's count, the planner's schedule's microbatches: batch / LLM dp
    assert shared_host_time(costs, choices, 8, HW, 2, 1.5, 1e-3).num_actions == 2 * 8 * 4
    # one thread dispatches them all: a step is never shorter than its dispatching
    slow = shared_host_time(costs, choices, 8, HW, 64, 1.5, 1.0, 4)
    assert slow.step_s == slow.host_s == pytest.approx(32.0)
