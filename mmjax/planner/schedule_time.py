"""The predicted iteration time of an integer plan on the schedule the runtime runs (no JAX):
1F1B over the plan's unit DAG (schedule/schedule.py `multimodal_one_f_one_b`: encoder
branches in parallel, then the LLM, then the generator; interleaved where vpp > 1), timed
by the one 1F1B timing model (schedule/simulate.py's recurrence, run compiled by
schedule/compiled_timing.py: the same rows and times, ~1 ms for a 72B plan), plus the DP
gradient sync. `ScheduleTimer(hw, "gpipe")` times GPipe's rows instead (the runtime's
`train.schedule`, schedule/compiled_named.py); the search itself prices 1F1B.

The search (orchestrate.py) minimises DistTrain's closed form (Eq. 1-2, evaluate.py), which
a convex solver can take and a recurrence cannot; the plan it picks is reported with this
time. The closed form sums every unit's warm-up where the schedule overlaps parallel
encoder branches, so for multi-branch models this time is the lower one; for one chain of
equal stages both are (m + p - 1) stage times.
"""
from __future__ import annotations

import numpy as np

from mmjax.models.units import UnitDag
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, forward_backward, p2p_time, runtime_memory,
                                    samples_per_rank, sync_time)
from mmjax.planner.hardware import Hardware
from mmjax.schedule.compiled_named import named_rows
from mmjax.schedule.compiled_timing import ChainLayout, makespan

def action_times(cost: UnitCost, c: Choice, dp_llm: int) -> tuple[float, float]:
    """(forward, backward) seconds of one microbatch on one (virtual) stage of the unit:
    its DP rank's samples, the unit's time split over pp x vpp stages."""
    fwd, bwd = forward_backward(cost, c.tp)
    per = samples_per_rank(c, dp_llm) / (c.pp * c.vpp)
    return per * fwd, per * bwd


class ScheduleTimer:
    """`schedule_time` for many plans: the rows of each pipeline shape (pp and vpp per unit,
    microbatches) are built once per timer (one planning call), since the many candidates
    of a search share few shapes and the rows alone take the deadlock-free warm-up loop.
    `schedule`: the pipeline schedule timed, by name (schedule/named.py; default 1F1B)."""

    def __init__(self, hw: Hardware, schedule: str = "1f1b"):
        self.hw, self.schedule = hw, schedule
        self._shapes: dict = {}

    def rows(self, choices: dict[str, Choice], m: int):
        key = (tuple((u, c.pp, c.vpp) for u, c in choices.items()), m)
        if key not in self._shapes:
            lay = ChainLayout.of(UnitDag.of(choices), {u: c.pp for u, c in choices.items()},
                                 {u: c.vpp for u, c in choices.items()})
            unit_of = np.repeat(np.arange(len(lay.units)),
                                [b - a for a, b in lay.unit_nodes])
            self._shapes[key] = (lay, named_rows(self.schedule, lay, m), unit_of)
        return self._shapes[key]

    def __call__(self, costs: tuple[UnitCost, ...], choices: dict[str, Choice],
                 global_batch: int, ran: bool = False, limit: float = np.inf) -> float:
        """Seconds per iteration of `choices` (each unit at the remat policy
        `runtime_memory` picks, as `evaluate`): the simulated makespan of the timer's
        schedule with one stage-to-stage transfer (the largest unit's boundary tensor)
        between dependent actions on different stages, plus the slowest DP sync. `ran`: `costs` are the
        variants `runtime_memory` picked already. `limit`: a time above it, not the exact
        one, for a plan slower than `limit` (compiled_timing.makespan)."""
        hw, dp_llm = self.hw, choices["llm"].dp
        m = global_batch // dp_llm
        if not ran:
            costs, _ = runtime_memory(costs, choices, global_batch, hw)
        lay, rows, unit_of = self.rows(choices, m)
        by_name = {c.name: action_times(c, choices[c.name], dp_llm) for c in costs}
        times = np.array([by_name[u] for u in lay.units])[unit_of]
        comm = max(p2p_time(c, choices[c.name], dp_llm, hw) for c in costs)
        sync = max(sync_time(c, choices[c.name], hw) for c in costs)
        return makespan(lay, rows, times[:, 0], times[:, 1], comm, limit - sync) + sync


def schedule_time(costs: tuple[UnitCost, ...], choices: dict[str, Choice], global_batch: int,
                  hw: Hardware, schedule: str = "1f1b") -> float:
    """`ScheduleTimer.__call__` of one plan under pipeline schedule `schedule`."""
    return ScheduleTimer(hw, schedule)(costs, choices, global_batch)
