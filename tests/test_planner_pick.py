"""The planner's pick (planner/pick.py, build.py, compare.py): the plan it reports is the
fastest by the simulated 1F1B schedule among what it timed, checked against the
event-walking simulation (schedule.py + simulate.py) on an exhaustively enumerated
candidate set; it is never slower than a baseline that fits on the papers' settings; and
every plan it prints fits by the memory count it prints."""
import itertools
import math

import numpy as np
import pytest

from mmjax.models.named import named_config
from mmjax.models.units import UnitDag
from mmjax.planner.baselines import BaselineDoesNotFit, megatron_choices, ratio_choices
from mmjax.planner.build import model_costs
from mmjax.planner.compare import plan_and_baselines
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice, p2p_time, runtime_memory, sync_time
from mmjax.planner.hardware import A800, H100, Hardware
from mmjax.planner.orchestrate import divisors
from mmjax.planner.pick import Proposal, pick_by_schedule
from mmjax.planner.schedule_bound import schedule_lower_bound
from mmjax.planner.schedule_time import action_times, schedule_time
from mmjax.schedule.schedule import multimodal_one_f_one_b
from mmjax.schedule.simulate import simulate
from mmjax.schedule.stage_graph import StageGraph


def reference_time(costs, choices, batch, hw):
    """The planner's schedule time by the event-walking Python: the runtime's rows
    (`multimodal_one_f_one_b`) timed by `simulate`, plus the slowest DP sync."""
    ran, _ = runtime_memory(costs, choices, batch, hw)
    dp = choices["llm"].dp
    times = {c.name: action_times(c, choices[c.name], dp) for c in ran}
    graph = StageGraph.from_dag(UnitDag.of(choices), {u: c.pp for u, c in choices.items()},
                                chunks={u: c.vpp for u, c in choices.items()})
    table = multimodal_one_f_one_b(graph, batch // dp)
    comm = max(p2p_time(c, choices[c.name], dp, hw) for c in ran)
    sync = max(sync_time(c, choices[c.name], hw) for c in ran)
    return simulate(table, lambda s, a: times[s.unit][a.kind == "B"], graph,
                    comm).iteration_time + sync


def small_costs(seed):
    rng = np.random.default_rng(seed)

    def unit(name, layers, seconds):
        tps = (1, 2)
        return UnitCost(name=name, num_layers=layers,
                        time_s={t: seconds / t ** 0.8 for t in tps},
                        weight_bytes=rng.uniform(2e9, 12e9), optimizer_bytes=rng.uniform(0, 8e9),
                        activation_bytes={t: rng.uniform(1e9, 6e9) / t for t in tps},
                        boundary_bytes=rng.uniform(1e6, 4e8), grad_bytes=rng.uniform(0, 4e9),
                        flops=1e12, layer_pp_divides=name == "llm")
    return (unit("vision", int(rng.integers(1, 4)), rng.uniform(0.1, 1.0)),
            unit("llm", 4, rng.uniform(1.0, 4.0)),
            unit("generator", int(rng.integers(1, 3)), rng.uniform(0.1, 1.0)))


HW = Hardware("test", peak_flops=1e14, hbm_bytes=20e9, nvlink_bw=2e11, nic_bw=2.5e10,
              gpus_per_node=8)


def every_plan(costs, n, batch):
    """Every integer plan within n GPUs: TP per unit, LLM DP | batch, unit DP | LLM DP,
    any valid PP, the LLM's VPP 1 or 2 where interleaving is valid."""
    for dp_llm in divisors(batch):
        m = batch // dp_llm
        per = []
        for c in costs:
            opts = []
            for tp in c.time_s:
                for dp in ([dp_llm] if c.name == "llm" else divisors(dp_llm)):
                    pps = divisors(c.num_layers) if c.layer_pp_divides else range(
                        1, c.num_layers + 1)
                    for pp in pps:
                        for v in ((1, 2) if c.name == "llm" else (1,)):
                            if v > 1 and (pp == 1 or c.num_layers % (pp * v) or m % pp):
                                continue
                            opts.append(Choice(tp, dp, pp, v))
            per.append(opts)
        for combo in itertools.product(*per):
            if sum(ch.gpus for ch in combo) <= n:
                yield {c.name: ch for c, ch in zip(costs, combo)}


@pytest.mark.parametrize("seed", range(4))
def test_the_pick_is_the_fastest_plan_by_the_schedule_among_every_plan(seed):
    """All integer plans of a 3-unit model on 10 GPUs as the candidates, least closed form
    first: the pick's time is the least event-walking time of any plan that fits (so the
    closed-form stopping rule loses nothing here), and the compiled timer agrees with the
    event walk on every plan it timed."""
    costs, n, batch = small_costs(seed), 10, 8
    plans = list(every_plan(costs, n, batch))
    fit = [ch for ch in plans
           if all(b <= HW.hbm_bytes for b in runtime_memory(costs, ch, batch, HW)[1].values())]
    assert fit and len(fit) < len(plans)  # memory rules some out
    want = min(reference_time(costs, ch, batch, HW) for ch in fit)
    proposals = [Proposal(schedule_lower_bound(costs, ch, batch, HW), costs, ch)
                 for ch in plans]
    for p in proposals:  # a lower bound indeed
        assert p.lower_bound_s <= schedule_time(costs, p.plan, batch, HW) * (1 + 1e-12)
    pick = pick_by_schedule(proposals, batch, HW, gpu_tolerance=0.0)
    assert pick.least_time_s == pytest.approx(want, rel=1e-12)
    assert pick.time_s == pytest.approx(want, rel=1e-12)
    assert reference_time(costs, pick.choices, batch, HW) == pick.time_s
    assert all(b <= HW.hbm_bytes for b in
               runtime_memory(costs, pick.choices, batch, HW)[1].values())
    assert pick.timed < len(fit)  # the bound spared most of the timing


def test_the_tie_break_never_goes_slower_than_a_baseline():
    """With a GPU tolerance the pick may take fewer GPUs for a little time, but never a plan
    slower than a baseline's that fits."""
    costs, batch = small_costs(1), 8
    plans = [ch for ch in every_plan(costs, 10, batch) if not any(
        b > HW.hbm_bytes for b in runtime_memory(costs, ch, batch, HW)[1].values())]
    timed = sorted(plans, key=lambda ch: schedule_time(costs, ch, batch, HW))
    best, base = timed[0], timed[1]
    proposals = [Proposal(schedule_lower_bound(costs, ch, batch, HW), costs, ch)
                 for ch in timed]
    pick = pick_by_schedule(proposals + [Proposal(0.0, costs, base, "megatron")], batch, HW,
                            gpu_tolerance=10.0)
    assert pick.time_s <= schedule_time(costs, base, batch, HW)
    assert schedule_time(costs, best, batch, HW) <= pick.time_s


# the papers' settings: DistTrain Table 2 and §8.2, OrchMLLM §8 (GPUs, global batch)
PAPER_SETTINGS = [("disttrain/mllm_72b", 1296, 1920), ("disttrain/mllm_72b", 648, 960),
                  ("disttrain/mllm_72b", 324, 480), ("disttrain/mllm_72b", 112, 240),
                  ("disttrain/mllm_9b", 98, 128), ("disttrain/mllm_15b", 98, 64),
                  ("disttrain/mllm_72b", 98, 40), ("orchmllm/mllm_10b", 128, 512),
                  ("orchmllm/mllm_18b", 128, 512), ("orchmllm/mllm_84b", 128, 256)]


@pytest.mark.parametrize("name,gpus,batch", PAPER_SETTINGS)
def test_never_slower_than_a_baseline_that_fits(name, gpus, batch):
    """plan.py's comparison on every DistTrain and OrchMLLM config at the papers' GPU
    counts: every plan printed fits by the memory it prints, each has one time (the
    simulated schedule), and the planner's is no slower than any baseline's."""
    model = named_config(name)
    hw = H100 if name.startswith("orchmllm") else A800
    res = plan_and_baselines(model, hw, gpus, batch)
    planner = res.plans["planner"].predicted
    for kind, plan in res.plans.items():
        p = plan.predicted
        assert max(p["memory_gb"].values()) * 1e9 <= hw.hbm_bytes, (kind, p["memory_gb"])
        assert p["gpus"] <= gpus
        assert p["samples_per_s"] == pytest.approx(batch / p["iteration_time_s"])
        assert planner["iteration_time_s"] <= p["iteration_time_s"] * (1 + 1e-12), kind
    for kind in ("megatron", "ratio"):
        assert kind in res.plans or kind in res.errors
        if kind in res.plans:
            assert res.speedup(kind) >= 1.0
    assert planner["optimal_time_s"] <= planner["iteration_time_s"]
    assert res.planning_time_s > 0 and planner["solve_time_s"] == res.planning_time_s


def test_the_reported_time_is_the_event_walking_schedule():
    """MLLM-9B on 98 GPUs: the printed time of each plan is the event-walking simulation of
    its choices, to the last bit of the compiled one."""
    model, hw = named_config("disttrain/mllm_9b"), A800
    res = plan_and_baselines(model, hw, 98, 128)
    costs, _ = model_costs(model, hw)
    for kind, plan in res.plans.items():
        ch = {u.name: Choice(u.tp * u.cp, u.dp, u.pp, u.num_chunks, u.remat)
              for u in plan.units}
        assert plan.predicted["iteration_time_s"] == pytest.approx(
            reference_time(costs, ch, 128, hw), rel=1e-12), kind


def test_a_baseline_that_cannot_be_repaired_does_not_fit():
    """Too few GPUs: Megatron runs out of pipeline stages to add and the FLOPs-ratio plan
    of GPUs to give the unit that overflows; both say so, and plan.py's comparison marks
    them instead of pricing a plan that cannot run."""
    model = named_config("disttrain/mllm_72b")
    costs, _ = model_costs(model, A800)
    with pytest.raises(BaselineDoesNotFit, match="does not fit"):
        megatron_choices(costs, A800, 40, 40, model_name=model.name)
    with pytest.raises(BaselineDoesNotFit, match="does not fit its FLOPs share"):
        ratio_choices(costs, A800, 33, 40)  # the LLM's 32 and one each for ViT and DiT
    res = plan_and_baselines(model, A800, 40, 40)
    assert "megatron" in res.errors and "megatron" not in res.plans
    assert res.speedup("megatron") is None and res.speedup("ratio") >= 1.0


def test_the_ratio_baseline_is_repaired_to_fit():
    """The FLOPs-ratio plan of MLLM-9B on 98 GPUs: the vision unit's FLOPs share does not
    hold its activations with the LLM's pipeline depth in flight; the baseline gives it
    more GPUs until it fits (its own repair), by the memory count the report shows."""
    model = named_config("disttrain/mllm_9b")
    costs, _ = model_costs(model, A800)
    ch = ratio_choices(costs, A800, 98, 128)
    _, need = runtime_memory(costs, ch, 128, A800)
    assert max(need.values()) <= A800.hbm_bytes
    assert sum(c.gpus for c in ch.values()) <= 98
    assert math.isfinite(schedule_time(costs, ch, 128, A800))


def test_the_frontier_columns_equal_each_plan_priced_alone():
    """The frontier's memory verdicts and schedule bounds, computed over every plan at once
    (frontier.py `Frontier`, frontier_memory.py), equal `runtime_memory` and
    `schedule_lower_bound` of each plan built alone (MLLM-9B, 98 GPUs: some plans do not
    fit with the runtime's in-flight microbatches)."""
    from mmjax.planner.orchestrate import orchestrate
    costs, _ = model_costs(named_config("disttrain/mllm_9b"), A800)
    front = orchestrate(costs, A800, 98, 128).frontier
    fits, bounds = front.fits(128, A800), front.lower_bounds()
    alone = []
    for k in range(len(front)):
        ch = front.choices(k)
        _, need = runtime_memory(costs, ch, 128, A800)
        alone.append(all(b <= A800.hbm_bytes for b in need.values()))
        assert bounds[k] == schedule_lower_bound(costs, ch, 128, A800), k
    assert fits.tolist() == alone
    assert 0 < sum(alone) < len(alone)
