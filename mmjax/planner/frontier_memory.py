"""The one memory count (evaluate.py `runtime_memory`) over many plans at once (no JAX).

The search's frontier holds thousands of plans; the pick (pick.py) times the few whose
schedule bound is low, and most of those it reads in a 72B search do not fit by the
runtime's in-flight count (an encoder holds the LLM's and the generator's depth too).
`fits_by_runtime` decides that for arrays of plans with the same arithmetic as
`pipeline_in_flight` and `stage_bytes` per plan, so the pick builds and prices only the
plans that fit.
"""
from __future__ import annotations

import numpy as np

from mmjax.models.units import UnitDag, is_encoder
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import stage_bytes, variants
from mmjax.planner.hardware import Hardware


def in_flight_arrays(dag: UnitDag, opts: dict, m) -> dict:
    """`pipeline_in_flight` over arrays: opts[unit] = (tp, dp, pp, vpp, variant) arrays
    (one entry per plan), m the plans' microbatches; per unit, its first stage's count."""
    after: dict = {}
    for name in reversed(dag.names):
        a = 0.0
        for v in dag.successors(name):
            a = np.maximum(a, opts[v][2] * opts[v][3] + after[v])
        after[name] = a
    out = {}
    for name, (_, _, pp, vpp, _) in opts.items():
        if is_encoder(name):
            out[name] = np.minimum(m, pp + after[name])
        else:
            own = np.where(vpp == 1, np.minimum(m, pp), np.minimum(m, ((vpp + 1) * pp - 1) / vpp))
            out[name] = np.minimum(m, own + after[name] / vpp)
    return out


def fits_by_runtime(costs: tuple[UnitCost, ...], opts: dict, global_batch: int,
                    hw: Hardware) -> np.ndarray:
    """Per plan, whether every unit's first stage fits `hw` at the remat variant the plan
    names (opts[unit][4]: an index into `evaluate.variants(cost)`), with the runtime's
    in-flight microbatches: `runtime_memory`'s verdict for plans whose choices carry their
    `remat` (the search's, `OptionTable.choice`)."""
    dag = UnitDag.of([c.name for c in costs])
    dp_llm = opts["llm"][1]
    flights = in_flight_arrays(dag, opts, global_batch // dp_llm)
    ok = np.ones(len(dp_llm), dtype=bool)
    for cost in costs:
        tp, dp, pp, _, pick = opts[cost.name]
        need = np.zeros(len(dp))
        for k, v in enumerate(variants(cost)):
            on = pick == k
            if on.any():
                need[on] = stage_bytes(v, tp[on], dp[on], pp[on], dp_llm[on] / dp[on],
                                       flights[cost.name][on], exact=True)
        ok &= need <= hw.hbm_bytes
    return ok
