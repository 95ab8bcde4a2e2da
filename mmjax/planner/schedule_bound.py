"""A lower bound of the simulated 1F1B schedule's iteration time (schedule_time.py), cheap
enough to rank thousands of candidate plans before timing any (no JAX).

Every physical stage of unit u runs its m microbatches' forwards and backwards one after
another (m x stage time per microbatch); it cannot start before microbatch 0's forward
has crossed every unit upstream of u, and after its last backward that microbatch's
backward still crosses them. So the makespan is at least, for every unit u,

    F_up(u) + m x stage_u + B_up(u),

F_up / B_up the longest chain of whole-unit forward / backward times upstream in the
unit DAG (transfers left out), each unit at its fastest remat policy; the slowest DP sync
follows the schedule. pick.py times plans in the order of this bound and stops once it
exceeds the best time found, so the pick is the fastest plan among its candidates.
"""
from __future__ import annotations

import numpy as np

from mmjax.models.units import UnitDag
from mmjax.planner.evaluate import Choice, fastest_forward_backward, samples_per_rank, sync_time
from mmjax.planner.hardware import Hardware


def chain_bound(dag: UnitDag, rows: dict):
    """The bound from per-unit terms (numpy-broadcastable): rows[unit] = (m x stage time,
    whole forward, whole backward, DP sync), all per microbatch of the unit's rank."""
    f_up, b_up, best, sync = {}, {}, 0.0, 0.0
    for u in dag.names:  # topological order
        preds = dag.predecessors(u)
        f_up[u] = 0.0
        b_up[u] = 0.0
        for p in preds:
            f_up[u] = np.maximum(f_up[u], f_up[p] + rows[p][1])
            b_up[u] = np.maximum(b_up[u], b_up[p] + rows[p][2])
        best = np.maximum(best, f_up[u] + rows[u][0] + b_up[u])
        sync = np.maximum(sync, rows[u][3])
    return best + sync


def schedule_lower_bound(costs, choices: dict[str, Choice], global_batch: int,
                         hw: Hardware) -> float:
    """`chain_bound` of one plan."""
    dp_llm = choices["llm"].dp
    m = global_batch // dp_llm
    rows = {}
    for c in costs:
        ch = choices[c.name]
        fwd, bwd = fastest_forward_backward(c, ch.tp)
        spr = samples_per_rank(ch, dp_llm)
        rows[c.name] = (m * spr * (fwd + bwd) / ch.pp, spr * fwd, spr * bwd,
                        sync_time(c, ch, hw))
    return float(chain_bound(UnitDag.of(choices), rows))
