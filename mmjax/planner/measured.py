"""Measured unit costs from runtime traces, with the analytic model as prior (no JAX).

A serial trace (pipeline/trace.py, `train.trace_every`) times every action of a step alone:
{stage, kind, microbatch, chunk, start, end, virtual_stage}. For a unit u running plan
(TP, DP, PP, layers per virtual stage), the analytic model (planner/costs.py) predicts
each action: the layers of its virtual stage x the per-layer (forward, backward) time of
one average sample at the unit's TP x the samples a rank holds per microbatch. The
measured profile keeps the analytic per-layer costs' shape and learns one factor per unit,
measured / predicted over its traced actions, shrunk toward 1 (the prior) by
`prior_actions` pseudo-observations: f_u = (prior + sum measured / mean predicted)
/ (prior + actions). Simplification: one factor per unit (not per layer or per TP); TP
sizes the run did not use are scaled by the same factor, as profile.py does for TP sizes
a machine cannot run.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

from mmjax.planner.costs import UnitCost
from mmjax.planner.plan import Plan


def predicted_actions(plan: Plan, layer_costs: dict) -> dict[tuple[str, str], float]:
    """Analytic seconds of one action per (virtual stage "unit:v", kind "F"/"B")."""
    out = {}
    per_rank = plan.microbatch_size
    for u in plan.units:
        per_layer = layer_costs[u.name][u.tp]
        samples = per_rank / u.dp
        start = 0
        for v, n in enumerate(u.layers):
            layers = per_layer[start:start + n]
            start += n
            out[(f"{u.name}:{v}", "F")] = samples * sum(f for f, _ in layers)
            out[(f"{u.name}:{v}", "B")] = samples * sum(b for _, b in layers)
    return out


def measured_actions(trace: list[dict]) -> dict[tuple[str, str], list[float]]:
    """Durations per (virtual stage, kind) of a trace (several traces may be concatenated)."""
    out = defaultdict(list)
    for d in trace:
        out[(d.get("virtual_stage", d["stage"]), d["kind"])].append(d["end"] - d["start"])
    return dict(out)


def unit_factors(plan: Plan, layer_costs: dict, trace: list[dict],
                 prior_actions: float = 4.0) -> dict[str, float]:
    """Per unit, measured / analytic time, shrunk toward 1 by `prior_actions`."""
    pred = predicted_actions(plan, layer_costs)
    meas = measured_actions(trace)
    unknown = sorted({k[0] for k in meas} - {k[0] for k in pred})
    if unknown:
        raise ValueError(f"trace stages {unknown} are not in the plan "
                         f"({sorted({k[0] for k in pred})}): trace a run of this plan")
    ratio: defaultdict[str, float] = defaultdict(float)
    count: defaultdict[str, int] = defaultdict(int)
    for key, times in meas.items():
        if pred[key] > 0:
            unit = key[0].rpartition(":")[0]
            ratio[unit] += sum(times) / pred[key]
            count[unit] += len(times)
    return {u.name: (prior_actions + ratio[u.name]) / (prior_actions + count[u.name])
            for u in plan.units}


def measured_costs(costs: tuple[UnitCost, ...], layer_costs: dict, factors: dict[str, float]):
    """(UnitCosts, layer costs) with every unit's times (each remat variant's too) scaled
    by its measured factor."""
    def scale(c):
        k = factors.get(c.name, 1.0)
        out = dataclasses.replace(c, time_s={t: v * k for t, v in c.time_s.items()},
                                  fwd_s={t: v * k for t, v in c.fwd_s.items()})
        if c.variants:
            out = dataclasses.replace(out, variants={p: scale(v) for p, v in c.variants.items()})
        return out
    out = tuple(scale(c) for c in costs)
    layers = {u: {t: [(f * factors.get(u, 1.0), b * factors.get(u, 1.0)) for f, b in lt]
                  for t, lt in per.items()} for u, per in layer_costs.items()}
    return out, layers


def stage_table(plan: Plan, layer_costs: dict, trace: list[dict]) -> list[dict]:
    """Per virtual stage: measured and predicted forward + backward seconds of one
    microbatch (means over the traced microbatches)."""
    pred = predicted_actions(plan, layer_costs)
    meas = measured_actions(trace)
    rows = []
    for stage in sorted({k[0] for k in pred}, key=lambda s: (s.rpartition(":")[0],
                                                             int(s.rpartition(":")[2]))):
        m = [sum(meas.get((stage, k), [])) / max(1, len(meas.get((stage, k), [])))
             for k in ("F", "B")]
        rows.append({"stage": stage, "measured_s": m[0] + m[1],
                     "predicted_s": pred[(stage, "F")] + pred[(stage, "B")],
                     "actions": sum(len(meas.get((stage, k), [])) for k in ("F", "B"))})
    return rows


def plan_changes(old: Plan, new: Plan) -> list[str]:
    """What `new` changes against `old`, one phrase per changed setting ("llm remat full ->
    none", "microbatches 2 -> 8"); empty when the two train alike."""
    out = []
    if old.num_microbatches != new.num_microbatches:
        out.append(f"microbatches {old.num_microbatches} -> {new.num_microbatches}")
    fields = ("dp", "tp", "pp", "cp", "layers", "num_chunks", "remat", "overlap_tp")
    for u in new.units:
        o = next((x for x in old.units if x.name == u.name), None)
        if o is None:
            out.append(f"{u.name} added")
            continue
        out += [f"{u.name} {f} {getattr(o, f)} -> {getattr(u, f)}" for f in fields
                if getattr(o, f) != getattr(u, f)]
    out += [f"{o.name} removed" for o in old.units if o.name not in {u.name for u in new.units}]
    return out


@dataclasses.dataclass(frozen=True)
class Replan:
    factors: dict[str, float]  # measured / analytic, per unit
    stages: list[dict]  # stage_table of the traced plan
    current_s: float  # the traced plan's iteration time under the measured costs
    plan: Plan  # the planner's plan for the measured costs
    predicted_s: float  # its iteration time under the measured costs

    @property
    def gain(self) -> float:
        """Iteration time before / after; exactly 1 when the plan does not change."""
        return self.current_s / self.predicted_s


def replan(model, plan: Plan, trace: list[dict], hw, num_gpus: int, workload=None,
           prior_actions: float = 4.0) -> Replan:
    """Learn the measured profile from `trace` (a run of `plan`) and plan again on it
    (DistTrain §5 on measured instead of analytic unit costs)."""
    from mmjax.planner.build import model_costs, plan_model
    from mmjax.planner.evaluate import Choice
    from mmjax.planner.schedule_time import schedule_time

    costs, layer_costs = model_costs(model, hw, workload)
    factors = unit_factors(plan, layer_costs, trace, prior_actions)
    m_costs, _ = measured_costs(costs, layer_costs, factors)
    current = {u.name: Choice(u.tp, u.dp, u.pp, u.num_chunks, u.remat) for u in plan.units}
    now = schedule_time(m_costs, current, plan.global_batch, hw)  # as `predicted` is
    new = plan_model(model, hw, num_gpus, plan.global_batch, workload=workload, costs=m_costs)
    # the same plan predicts the same time: no gain from re-planning into what runs
    after = now if not plan_changes(plan, new) else new.predicted["iteration_time_s"]
    return Replan(factors, stage_table(plan, layer_costs, trace), now, new, after)
