"""From model to a validated, priced `Plan`: unit costs on the paper workload, Algorithm 1
(orchestrate.py), frozen-aware layer splits (partition.py) and `Plan.predicted` (no JAX)."""
from __future__ import annotations

import dataclasses

from mmjax.planner.costs import UnitCost, layer_times, unit_costs
from mmjax.planner.unit_work import impl_of, unit_work
from mmjax.planner.evaluate import (Choice, evaluate, in_flight, pipeline_in_flight,
                                    runtime_memory)
from mmjax.planner.hardware import Hardware
from mmjax.planner.knobs import CP_SIZES, LONG_SEQUENCE, cp_cost, overlap_pays, zero_cost
from mmjax.planner.memory import ZERO_STAGES
from mmjax.planner.orchestrate import GPU_TOLERANCE, orchestrate
from mmjax.planner.partition import partition_unit
from mmjax.planner.plan import Plan, PlanError, UnitPlan
from mmjax.planner.workload import default_workload
from mmjax.planner.schedule_time import schedule_time
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
            attention_impl=None, cp: int = 1) -> Plan:
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
    t = schedule_time(costs, choices, global_batch, hw)
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
               gpu_tolerance: float = GPU_TOLERANCE, attention_impl=None) -> Plan:
    """The disaggregated plan for `model` on `num_gpus` GPUs (DistTrain §5); `costs`
    (e.g. from profile.profiled_costs) replace the analytic unit costs; among plans within
    `gpu_tolerance` of the least time, the one with the fewest GPUs (orchestrate.py). Per
    unit the plan's `remat` is the least recompute that fits; the LLM gets context
    parallelism when sequences are long or nothing fits without it and it is faster
    (planner/knobs.py), and overlapped TP where the cost model says it hides the TP
    collectives. When no plan fits at ZeRO-1, every unit (but the forward-only VAE, whole on
    each device) at ZeRO-2, then at ZeRO-3 (`knobs.zero_cost`: its sharded state, gathered
    layers and traffic)."""
    wl = workload or default_workload(model)
    analytic, layer_costs = model_costs(model, hw, wl, recompute, attention_impl)
    costs = costs or analytic
    first = None
    for zero in ZERO_STAGES:  # ZeRO-2, then 3, only when nothing fits at the stage before
        try:
            zeroed = tuple(c if is_vae(c.name) else zero_cost(c, zero, hw) for c in costs)
            return _fit(model, wl, zeroed, layer_costs, hw, num_gpus, global_batch, vpp,
                        gpu_tolerance, attention_impl)
        except PlanError as e:
            first = first or e
    raise first


def _fit(model, wl, costs, layer_costs, hw, num_gpus, global_batch, vpp, gpu_tolerance,
         attention_impl) -> Plan:
    """`_solve` until every stage fits with the runtime's in-flight microbatches."""
    for _ in range(FIT_ROUNDS):
        plan = _solve(model, wl, costs, layer_costs, hw, num_gpus, global_batch, vpp,
                      gpu_tolerance, attention_impl)
        over = {u.name: plan.predicted["memory_gb"][u.name] * 1e9 / hw.hbm_bytes
                for u in plan.units if plan.predicted["memory_gb"][u.name] * 1e9 > hw.hbm_bytes}
        if not over:
            return plan
        costs = tuple(_deeper(c, plan, global_batch) if c.name in over else c for c in costs)
    raise PlanError(f"planner: no plan found whose stages fit {hw.hbm_bytes / 1e9:.0f} GB per "
                    f"GPU with the runtime's in-flight microbatches (over: "
                    f"{sorted(over)}): add GPUs or memory")


# Re-solves when a unit's first stage holds more microbatches under the runtime's schedule
# than the orchestrator's per-unit 1F1B count (an encoder also holds the LLM's depth).
FIT_ROUNDS = 6


def _deeper(cost: UnitCost, plan: Plan, global_batch: int) -> UnitCost:
    """`cost` whose per-in-flight activation terms the orchestrator scales by the runtime's
    in-flight count over its own (evaluate.pipeline_in_flight / in_flight) in `plan`."""
    choices = {u.name: Choice(u.tp * u.cp, u.dp, u.pp, u.num_chunks) for u in plan.units}
    m = plan.num_microbatches
    k = pipeline_in_flight(choices, m)[cost.name] / in_flight(choices[cost.name], m)
    k = max(k, cost.flight_scale)
    out = dataclasses.replace(cost, flight_scale=k)
    if cost.variants:
        out = dataclasses.replace(out, variants={
            p: dataclasses.replace(v, flight_scale=k) for p, v in cost.variants.items()})
    return out


def _solve(model, wl, costs, layer_costs, hw, num_gpus, global_batch, vpp, gpu_tolerance,
           attention_impl) -> Plan:
    if any(c.zero_stage > 1 for c in costs):  # the planner's ZeRO-2/3 runs without CP
        best, error = _fastest_cp(model, wl, costs, (1,), hw, num_gpus, global_batch, vpp,
                                  gpu_tolerance)
        if best is None:
            raise error
        return _finish(model, wl, best, layer_costs, global_batch, hw, attention_impl)
    long = wl.llm_moments()[0] >= LONG_SEQUENCE
    best, error = _fastest_cp(model, wl, costs, (1,) + (CP_SIZES if long else ()), hw,
                              num_gpus, global_batch, vpp, gpu_tolerance)
    if best is None and not long:  # nothing fits without context parallelism
        best, _ = _fastest_cp(model, wl, costs, CP_SIZES, hw, num_gpus, global_batch, vpp,
                              gpu_tolerance)
    if best is None:
        raise error
    return _finish(model, wl, best, layer_costs, global_batch, hw, attention_impl)


def _fastest_cp(model, wl, costs, cps, hw, num_gpus, global_batch, vpp, gpu_tolerance):
    """((cp, OrchestrationResult, costs) of the fastest LLM CP size in `cps`, or None;
    the first PlanError). Each CP size's plan is scored by its schedule's time
    (schedule_time.py), as it is reported."""
    best, error, best_t = None, None, float("inf")
    for cp in cps:
        try_costs = tuple(cp_cost(model, wl, c, cp, hw) if is_llm(c.name) else c
                          for c in costs)
        if any(not c.time_s for c in try_costs):  # no tp x cp group fits in a node
            continue
        try:
            res = orchestrate(try_costs, hw, num_gpus, global_batch, vpp, gpu_tolerance)
        except PlanError as e:
            error = error or e
            continue
        t = schedule_time(try_costs, res.choices, global_batch, hw)
        if t < best_t:
            best, best_t = (cp, res, try_costs), t
    return best, error


def _finish(model, wl, best, layer_costs, global_batch, hw, attention_impl) -> Plan:
    cp, res, costs = best
    if cp > 1:
        layer_costs = {**layer_costs, "llm": {t * cp: v for t, v in layer_costs["llm"].items()}}
    plan = to_plan(model, costs, res.choices, global_batch, hw, "disaggregated", layer_costs,
                   res.solve_time_s, res.optimal_time_s, attention_impl, cp=cp)
    llm = plan.unit("llm")
    if cp == 1 and llm.attention_impl != "pallas" and llm.zero_stage < 3 and overlap_pays(
            model, wl, llm.tp, hw, attention_impl):
        units = tuple(dataclasses.replace(u, overlap_tp=True) if is_llm(u.name) else u
                      for u in plan.units)
        plan = dataclasses.replace(plan, units=units).validate(model, plan.num_devices)
    return plan
