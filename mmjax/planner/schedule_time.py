"""The predicted iteration time of an integer plan on the schedule the runtime runs (no JAX):
1F1B over the plan's unit DAG (schedule/schedule.py `multimodal_one_f_one_b`: encoder
branches in parallel, then the LLM, then the generator; interleaved where vpp > 1), timed
by the one 1F1B timing model (schedule/simulate.py), plus the DP gradient sync.

The search (orchestrate.py) minimises DistTrain's closed form (Eq. 1-2, evaluate.py), which
a convex solver can take and a recurrence cannot; the plan it picks is reported with this
time. The closed form sums every unit's warm-up where the schedule overlaps parallel
encoder branches, so for multi-branch models this time is the lower one; for one chain of
equal stages both are (m + p - 1) stage times.
"""
from __future__ import annotations

from mmjax.models.units import UnitDag
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, p2p_time, remat_variant, samples_per_rank,
                                    sync_time)
from mmjax.planner.hardware import Hardware
from mmjax.schedule.schedule import multimodal_one_f_one_b
from mmjax.schedule.simulate import simulate
from mmjax.schedule.stage_graph import StageGraph

FORWARD_SHARE = 1 / 3  # forward : backward = 1 : 2 where a cost gives no forward time


def action_times(cost: UnitCost, c: Choice, dp_llm: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one (virtual) stage of the unit:
    its DP rank's samples, the unit's time split over pp x vpp stages."""
    whole = cost.time_s[c.tp]
    fwd = cost.fwd_s.get(c.tp, FORWARD_SHARE * whole)
    per = samples_per_rank(c, dp_llm) / (c.pp * c.vpp)
    return per * fwd, per * (whole - fwd)


def schedule_time(costs: tuple[UnitCost, ...], choices: dict[str, Choice], global_batch: int,
                  hw: Hardware) -> float:
    """Seconds per iteration of `choices` (with `evaluate`'s remat choice per unit): the
    simulated 1F1B makespan with one stage-to-stage transfer (the largest unit's boundary
    tensor) between dependent actions on different stages, plus the slowest DP sync."""
    dp_llm = choices["llm"].dp
    m = global_batch // dp_llm
    costs = tuple(remat_variant(c, choices[c.name], dp_llm, m, hw.hbm_bytes) for c in costs)
    times = {c.name: action_times(c, choices[c.name], dp_llm) for c in costs}
    graph = StageGraph.from_dag(UnitDag.of(choices), {u: c.pp for u, c in choices.items()},
                                chunks={u: c.vpp for u, c in choices.items()})
    table = multimodal_one_f_one_b(graph, m)
    fb = lambda stage, action: times[stage.unit][action.kind == "B"]  # noqa: E731
    comm = max(p2p_time(c, choices[c.name], dp_llm, hw) for c in costs)
    sync = max(sync_time(c, choices[c.name], hw) for c in costs)
    return simulate(table, fb, graph, comm).iteration_time + sync
