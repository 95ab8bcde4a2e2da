"""A lower bound of the simulated 1F1B schedule's iteration time (schedule_time.py), cheap
enough to rank thousands of candidate plans before timing any (no JAX).

Every physical stage of unit u runs its m microbatches' forwards and backwards one after
another (m x its time per microbatch). Its last stage cannot start before microbatch 0's
forward has crossed every virtual stage upstream of it -- the longest chain through the
units upstream in the DAG, then the unit's own first pp - 1 virtual stages -- each
crossing paying one transfer (the schedule's `comm`); after its last backward (chunk 0
under interleaving) that microbatch's backward crosses them back. So the makespan is at
least, for every unit u,

    F_up(u) + (pp_u - 1) (f_u + b_u + 2 comm) + m x stage_u + B_up(u),

F_up / B_up the longest chain of whole-unit forward / backward times plus a transfer per
virtual stage upstream, f_u / b_u one virtual stage's forward / backward, each unit at its
fastest remat policy; the slowest DP sync follows the schedule. For one chain of equal
stages this is the schedule's time. pick.py times plans in the order of this bound and
stops once it exceeds the best time found, so the pick is the fastest plan among its
candidates.
"""
from __future__ import annotations

import numpy as np

from mmjax.models.units import UnitDag
from mmjax.planner.evaluate import (Choice, fastest_forward_backward, p2p_time,
                                    samples_per_rank, sync_time)
from mmjax.planner.hardware import Hardware


def chain_bound(dag: UnitDag, rows: dict):
    """The bound from per-unit terms (numpy-broadcastable): rows[unit] = (m x stage time,
    whole forward, whole backward, DP sync, virtual stages pp x vpp, pp, one virtual
    stage's forward + backward, transfer time), per microbatch of the unit's rank."""
    comm = 0.0
    for r in rows.values():
        comm = np.maximum(comm, r[7])
    f_up, b_up, best, sync = {}, {}, 0.0, 0.0
    for u in dag.names:  # topological order
        f_up[u] = 0.0
        b_up[u] = 0.0
        for p in dag.predecessors(u):
            f_up[u] = np.maximum(f_up[u], f_up[p] + rows[p][1] + rows[p][4] * comm)
            b_up[u] = np.maximum(b_up[u], b_up[p] + rows[p][2] + rows[p][4] * comm)
        busy, _, _, unit_sync, _, pp, fb, _ = rows[u]
        fill = (pp - 1) * (fb + 2 * comm)
        best = np.maximum(best, f_up[u] + fill + busy + b_up[u])
        sync = np.maximum(sync, unit_sync)
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
                        sync_time(c, ch, hw), ch.pp * ch.vpp, ch.pp,
                        spr * (fwd + bwd) / (ch.pp * ch.vpp), p2p_time(c, ch, dp_llm, hw))
    return float(chain_bound(UnitDag.of(choices), rows))
