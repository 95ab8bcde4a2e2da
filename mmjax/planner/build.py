"""From model to a validated, priced `Plan`: unit costs on the paper workload, Algorithm 1
(orchestrate.py), frozen-aware layer splits (partition.py) and `Plan.predicted` (no JAX)."""
from __future__ import annotations

import dataclasses
import time

from mmjax.planner.costs import UnitCost, layer_times, unit_costs
from mmjax.planner.unit_work import impl_of, unit_work
from mmjax.planner.evaluate import (Choice, evaluate, in_flight, over_memory,
                                    pipeline_in_flight, runtime_memory)
from mmjax.planner.hardware import Hardware
from mmjax.planner.knobs import CP_SIZES, LONG_SEQUENCE, cp_cost, overlap_pays, zero_cost
from mmjax.planner.memory import ZERO_STAGES
from mmjax.planner.orchestrate import GPU_TOLERANCE, SearchState, orchestrate
from mmjax.planner.partition import partition_unit
from mmjax.planner.plan import Plan, PlanError, UnitPlan
from mmjax.planner.workload import default_workload
from mmjax.planner.pick import FrontierProposals, Proposal, Proposals, pick_by_schedule
from mmjax.planner.schedule_bound import schedule_lower_bound
from mmjax.planner.schedule_time import ScheduleTimer
from mmjax.models.units import is_llm, is_vae


# DistTrain §8.3.1: four frozen settings; the projectors are always trained
DISTTRAIN_FROZEN = {
    "all frozen": {"encoders.vision.frozen": True, "llm_frozen": True, "generator_frozen": True},
    "encoder only": {"llm_frozen": True, "generator_frozen": True},
    "llm only": {"encoders.vision.frozen": True, "generator_frozen": True},
    "generator only": {"encoders.vision.frozen": True, "llm_frozen": True},
}


def to_plan(model, costs: tuple[UnitCost, ...], choices: dict[str, Choice], global_batch: int,
            hw: Hardware, kind: str, layer_costs: dict | None = None,
            solve_time_s: float = 0.0, optimal_time_s: float | None = None,
            attention_impl=None, cp: int = 1, timer: ScheduleTimer | None = None) -> Plan:
    """A validated `Plan` for integer `choices`, layers split frozen-aware (partition.py)
    over pp x vpp virtual stages, with `predicted` filled: `iteration_time_s` (and
    `samples_per_s`, `mfu`) from the simulated 1F1B schedule (schedule_time.py);
    `closed_form_s` and its terms `warmup_s`, `steady_s`, `sync_s` from `evaluate`
    (DistTrain Eq. 1-2, what the search minimises)."""
    units = []
    ran = {c.name: c for c in runtime_memory(costs, choices, global_batch, hw)[0]}
    for cost in costs:
        ch = choices[cost.name]
        stages = ch.pp * ch.vpp
        if layer_costs and cost.name in layer_costs:
            layers = partition_unit(cost.name, layer_costs[cost.name][ch.tp], stages).split
        else:
            layers = Plan.even_layers(cost.num_layers, stages)
        remat = ran[cost.name].remat
        g = cp if is_llm(cost.name) else 1  # the LLM's cost is keyed by tp * cp (knobs.py)
        units.append(UnitPlan(name=cost.name, dp=ch.dp, tp=ch.tp // g, pp=ch.pp, cp=g,
                              layers=layers, num_chunks=ch.vpp, frozen=model.frozen(cost.name),
                              remat=remat, zero_stage=cost.zero_stage,
                              attention_impl=impl_of(attention_impl, cost.name) or "auto"))
    dp_llm = choices["llm"].dp
    plan = Plan(tuple(units), global_batch, global_batch // dp_llm, kind=kind,
                devices_per_node=hw.gpus_per_node)
    ev = evaluate(costs, choices, global_batch, hw)
    t = (timer or ScheduleTimer(hw))(costs, choices, global_batch)
    plan.predicted.update({
        "iteration_time_s": t, "mfu": ev.mfu * ev.iteration_time_s / t,
        "closed_form_s": ev.iteration_time_s, "memory_gb": ev.memory_gb,
        "stage_time_s": ev.stage_time_s, "warmup_s": ev.warmup_s, "steady_s": ev.steady_s,
        "sync_s": ev.sync_s, "gpus": ev.gpus,
        "samples_per_s": global_batch / t, "solve_time_s": solve_time_s,
        "hardware": hw.name})
    if optimal_time_s is not None:  # least time before the fewest-GPUs tie-break
        plan.predicted["optimal_time_s"] = optimal_time_s
    return plan.validate(model, ev.gpus)


def model_costs(model, hw: Hardware, workload=None, recompute="auto", attention_impl=None):
    """(UnitCosts, per-unit per-TP layer costs) of `model` on its paper workload; with
    `attention_impl` (a name or {unit: name}) attention is costed by that implementation's
    tiles (planner/attention_cost.py). `recompute`: "auto" (each unit may take any remat
    policy: the least recompute that fits, per choice), a policy, a bool, or {unit: ...}."""
    wl = workload or default_workload(model)
    costs = unit_costs(model, wl, hw, recompute, attention_impl)
    layer_costs = {c.name: {t: layer_times(unit_work(model, wl, c.name, attention_impl), t, hw,
                                           c.remat)
                            for t in c.time_s} for c in costs}
    return costs, layer_costs


def plan_model(model, hw: Hardware, num_gpus: int, global_batch: int, workload=None,
               recompute="auto", vpp: bool = True, costs=None,
               gpu_tolerance: float = GPU_TOLERANCE, attention_impl=None,
               baselines: dict | None = None, analytic=None) -> Plan:
    """The disaggregated plan for `model` on `num_gpus` GPUs (DistTrain §5); `costs`
    (e.g. from profile.profiled_costs) replace the analytic unit costs. The closed-form
    search (orchestrate.py) proposes its frontier; every proposal, and each baseline's
    choices in `baselines` ({kind: {unit: Choice}}), is timed by the simulated 1F1B
    schedule, and the fastest that fits in memory by the runtime's count wins; among plans
    within `gpu_tolerance` of it, and no slower than a baseline, the one with the fewest
    GPUs (pick.py). Per unit the plan's `remat` is the least recompute that fits; the LLM
    gets context parallelism when sequences are long or nothing fits without it and it is
    faster (planner/knobs.py), and overlapped TP where the cost model says it hides the TP
    collectives. When no plan fits at ZeRO-1, every unit (but the forward-only VAE, whole
    on each device) at ZeRO-2, then at ZeRO-3 (`knobs.zero_cost`: its sharded state,
    gathered layers and traffic). `predicted["solve_time_s"]` is this whole call's time.
    `analytic`: `model_costs(model, hw, workload, recompute, attention_impl)` when the
    caller has them."""
    start = time.perf_counter()
    wl = workload or default_workload(model)
    analytic, layer_costs = analytic or model_costs(model, hw, wl, recompute, attention_impl)
    costs = costs or analytic
    timer = ScheduleTimer(hw)
    first = None
    for zero in ZERO_STAGES:  # ZeRO-2, then 3, only when nothing fits at the stage before
        try:
            zeroed = tuple(c if is_vae(c.name) else zero_cost(c, zero, hw) for c in costs)
            plan = _fit(model, wl, zeroed, layer_costs, hw, num_gpus, global_batch, vpp,
                        gpu_tolerance, attention_impl, baselines if zero == 1 else None,
                        timer)
            plan.predicted["solve_time_s"] = time.perf_counter() - start
            return plan
        except PlanError as e:
            first = first or e
    assert first is not None  # ZERO_STAGES is not empty: a loop without a plan raised
    raise first


def _fit(model, wl, costs, layer_costs, hw, num_gpus, global_batch, vpp, gpu_tolerance,
         attention_impl, baselines, timer) -> Plan:
    """Search; when the closed form's best plan does not fit with the runtime's in-flight
    microbatches, search again with the units that overflowed deepened (`_deeper`). Pick
    by the schedule among every round's proposals and the baselines' plans once the
    closed form's best fits or a deepened round is in, deepening further while none
    fits."""
    names = {c.name for c in costs}
    fixed = [Proposal(schedule_lower_bound(costs, ch, global_batch, hw), costs, ch, kind)
             for kind, ch in (baselines or {}).items()
             if set(ch) == names and sum(c.gpus for c in ch.values()) <= num_gpus]
    pools, error, over = [], None, {}
    reuse: dict[int, SearchState] = {}  # per CP size
    for rounds in range(FIT_ROUNDS):
        found, err = _search_cps(model, wl, costs, hw, num_gpus, global_batch, vpp,
                                 gpu_tolerance, reuse)
        error = error or err
        if not found:
            break
        pools += found
        _, res, cp_costs = found[0]
        over = over_memory(cp_costs, res.choices, global_batch, hw)
        if not over or rounds:  # the closed form's best fits, or a deepened round is in
            parts: list[list[Proposal] | FrontierProposals] = [fixed]
            parts += [_proposals(cp, r, c, global_batch, hw) for cp, r, c in pools]
            proposals = Proposals(parts)
            pick = pick_by_schedule(proposals, global_batch, hw, gpu_tolerance, timer)
            if pick is not None:
                return _finish(model, wl, pick, layer_costs, global_batch, hw,
                               attention_impl, timer)
        costs = tuple(_deeper(c, res.choices, global_batch) if c.name in over else c
                      for c in costs)
        changed = {i for i, c in enumerate(costs) if c.name in over}
        llm = next(i for i, c in enumerate(costs) if is_llm(c.name))
        reuse = {cp: r.state.keep(changed, llm) for cp, r, _ in found if r.state is not None}
    pick = pick_by_schedule(fixed, global_batch, hw, gpu_tolerance, timer)
    if pick is not None:
        return _finish(model, wl, pick, layer_costs, global_batch, hw, attention_impl, timer)
    if not pools:
        raise error or PlanError(f"planner: no LLM tp x cp group fits in a node of "
                                 f"{hw.gpus_per_node} GPUs")
    raise PlanError(f"planner: no plan found whose stages fit {hw.hbm_bytes / 1e9:.0f} GB per "
                    f"GPU with the runtime's in-flight microbatches (over: "
                    f"{sorted(over)}): add GPUs or memory")


# Re-solves when a unit's first stage holds more microbatches under the runtime's schedule
# than the orchestrator's per-unit 1F1B count (an encoder also holds the LLM's depth).
FIT_ROUNDS = 6


def _deeper(cost: UnitCost, choices: dict[str, Choice], global_batch: int) -> UnitCost:
    """`cost` whose per-in-flight activation terms the orchestrator scales by the runtime's
    in-flight count over its own (evaluate.pipeline_in_flight / in_flight) in `choices`."""
    m = global_batch // choices["llm"].dp
    k = pipeline_in_flight(choices, m)[cost.name] / in_flight(choices[cost.name], m)
    k = max(k, cost.flight_scale)
    out = dataclasses.replace(cost, flight_scale=k)
    if cost.variants:
        out = dataclasses.replace(out, variants={
            p: dataclasses.replace(v, flight_scale=k) for p, v in cost.variants.items()})
    return out


def _search_cps(model, wl, costs, hw, num_gpus, global_batch, vpp, gpu_tolerance, reuse):
    """([(cp, OrchestrationResult, costs)] of the LLM CP sizes searched, the first
    PlanError): CP 1 (and CP_SIZES for long sequences); CP_SIZES when nothing fits
    without it. The planner's ZeRO-2/3 runs without CP. `reuse`: per CP size, what an
    earlier round's search may hand this one (orchestrate.SearchState)."""
    if any(c.zero_stage > 1 for c in costs):
        return _search(model, wl, costs, (1,), hw, num_gpus, global_batch, vpp, gpu_tolerance,
                       reuse)
    long = wl.llm_moments()[0] >= LONG_SEQUENCE
    pools, error = _search(model, wl, costs, (1,) + (CP_SIZES if long else ()), hw,
                           num_gpus, global_batch, vpp, gpu_tolerance, reuse)
    if not pools and not long:  # nothing fits without context parallelism
        pools, _ = _search(model, wl, costs, CP_SIZES, hw, num_gpus, global_batch, vpp,
                           gpu_tolerance, reuse)
    return pools, error


def _search(model, wl, costs, cps, hw, num_gpus, global_batch, vpp, gpu_tolerance, reuse):
    pools, error = [], None
    for cp in cps:
        try_costs = tuple(cp_cost(model, wl, c, cp, hw) if is_llm(c.name) else c
                          for c in costs)
        if any(not c.time_s for c in try_costs):  # no tp x cp group fits in a node
            continue
        try:
            pools.append((cp, orchestrate(try_costs, hw, num_gpus, global_batch, vpp,
                                          gpu_tolerance, reuse=reuse.get(cp)), try_costs))
        except PlanError as e:
            error = error or e
    return pools, error


def _proposals(cp, res, costs, global_batch, hw) -> "list[Proposal] | FrontierProposals":
    """The search's frontier at one CP size as Proposals, each with its schedule's lower
    bound (built lazily: only the plans timed are)."""
    front = res.frontier
    if front is None or not len(front):
        return [Proposal(schedule_lower_bound(costs, res.choices, global_batch, hw), costs,
                         res.choices, "search", cp)]
    return FrontierProposals(front.lower_bounds(), costs, front, cp,
                             front.fits(global_batch, hw))


def _finish(model, wl, pick, layer_costs, global_batch, hw, attention_impl, timer) -> Plan:
    p = pick.proposal
    cp = p.cp
    if cp > 1:
        layer_costs = {**layer_costs, "llm": {t * cp: v for t, v in layer_costs["llm"].items()}}
    plan = to_plan(model, p.costs, pick.choices, global_batch, hw, "disaggregated", layer_costs,
                   0.0, pick.least_time_s, attention_impl, cp=cp, timer=timer)
    plan.predicted.update({"timed_plans": pick.timed, "over_memory_plans": pick.over_memory,
                           "candidates": pick.candidates,
                           "picked_from": p.source})
    llm = plan.unit("llm")
    if cp == 1 and llm.attention_impl != "pallas" and llm.zero_stage < 3 and overlap_pays(
            model, wl, llm.tp, hw, attention_impl):
        units = tuple(dataclasses.replace(u, overlap_tp=True) if is_llm(u.name) else u
                      for u in plan.units)
        plan = dataclasses.replace(plan, units=units).validate(model, plan.num_devices)
    return plan
