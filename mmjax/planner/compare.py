"""The planner's plan beside the baselines', priced one way (no JAX): what
scripts/plan.py prints and scripts/bench_planner.py records.

`plan_and_baselines` computes the unit costs once, builds Megatron-LM's rigid plan and the
FLOPs-ratio plan (baselines.py, each repaired the way its method would, or marked as not
fitting), hands their choices to the planner's candidate set (build.py `plan_model`: the
fastest by the simulated schedule wins, so the planner is never slower than a baseline
that fits), and prices all of them with the same simulated schedule and the same memory
count. `planning_time_s` is the whole call but for the compiled kernels' load (once per
process, `kernel_load_s`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from mmjax.planner.baselines import megatron_choices, ratio_choices
from mmjax.planner.build import model_costs, plan_model, to_plan
from mmjax.planner.orchestrate import GPU_TOLERANCE
from mmjax.planner.partition import balanced_split
from mmjax.planner.plan import Plan, PlanError
from mmjax.planner.schedule_time import ScheduleTimer
from mmjax.planner.workload import default_workload
from mmjax.schedule.compiled_timing import load_kernels

BASELINES = ("megatron", "ratio")
PLAN_KINDS = {"megatron": "rigid", "ratio": "ratio"}


@dataclass(frozen=True)
class Comparison:
    plans: dict[str, Plan]  # "planner" and the baselines that fit
    errors: dict[str, str]  # why a plan is missing: the baseline does not fit, or no plan
    planning_time_s: float  # costs, baselines, search and every simulated schedule
    kernel_load_s: float = 0.0  # once per process, before the timing: numba's start-up
    planning_cpu_s: float = 0.0  # this process's CPU time over the same span

    def speedup(self, kind: str) -> float | None:
        """The baseline's time over the planner's (None: one of them is missing)."""
        if "planner" not in self.plans or kind not in self.plans:
            return None
        return (self.plans[kind].predicted["iteration_time_s"]
                / self.plans["planner"].predicted["iteration_time_s"])


def plan_and_baselines(model, hw, num_gpus: int, global_batch: int, workload=None,
                       recompute="auto", vpp: bool = True, costs=None,
                       gpu_tolerance: float = GPU_TOLERANCE, attention_impl=None,
                       planner=None) -> Comparison:
    """The planner's plan and the baselines on `num_gpus` GPUs. `planner(plan_fn)`
    replaces the plain call `plan_fn(model, num_gpus)` (e.g. the VAE placement, which
    plans the trained units on fewer GPUs); `plan_fn` includes the baselines' plans in
    the candidates wherever their units and GPUs match."""
    loading = time.perf_counter()
    load_kernels()
    balanced_split([1.0, 1.0], 2)
    start, cpu = time.perf_counter(), time.process_time()
    wl = workload or default_workload(model)
    analytic, layer_costs = model_costs(model, hw, wl, recompute, attention_impl)
    priced = costs or analytic
    plans, errors, choices = {}, {}, {}
    for kind in BASELINES:
        try:
            choices[kind] = (megatron_choices(priced, hw, num_gpus, global_batch,
                                              model_name=model.name) if kind == "megatron"
                             else ratio_choices(priced, hw, num_gpus, global_batch))
        except PlanError as e:
            errors[kind] = " ".join(str(e).split())

    def plan_fn(m, gpus):
        same = m is model
        return plan_model(m, hw, gpus, global_batch, workload=wl, recompute=recompute,
                          vpp=vpp, costs=costs if same else None,
                          gpu_tolerance=gpu_tolerance, attention_impl=attention_impl,
                          baselines=choices if same else None,
                          analytic=(analytic, layer_costs) if same else None)
    try:
        plans["planner"] = (planner or (lambda fn: fn(model, num_gpus)))(plan_fn)
    except PlanError as e:
        errors["planner"] = " ".join(str(e).split())
    timer = ScheduleTimer(hw)
    for kind, ch in choices.items():
        plans[kind] = to_plan(model, priced, ch, global_batch, hw, PLAN_KINDS[kind],
                              layer_costs, timer=timer)
    took = time.perf_counter() - start
    if "planner" in plans:
        plans["planner"].predicted["solve_time_s"] = took
    return Comparison(plans, errors, took, start - loading, time.process_time() - cpu)
