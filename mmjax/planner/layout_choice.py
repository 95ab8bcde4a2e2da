"""Co-located or disaggregated: which layout a model should train in, and why (no JAX).

`plan.py --layout=auto` prices both (the disaggregated planner's best plan, DistTrain §5;
the co-located layout's best choice, planner/colocated.py, OrchMLLM §4-7) on the same unit
costs and picks the one with the lower predicted iteration time. The reason names the terms
that decide it: co-located runs every phase on every GPU one after another, paying its
exposed collectives (ZeRO syncs and gathers, the encoder->LLM all-to-all); disaggregated
runs units side by side on their own GPUs: its slowest stage is busy for every microbatch,
and the simulated 1F1B schedule adds pipeline fill, drain and the gradient sync.
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.planner.plan import PlanError

LAYOUTS = ("auto", "colocated", "disaggregated")


def seconds(x: float) -> str:
    """A predicted time for the reason line: seconds to the millisecond, milliseconds below
    10 ms (a tiny model's step)."""
    return f"{x:.3f} s" if x >= 0.01 else f"{x * 1e3:.4f} ms"


@dataclass(frozen=True)
class LayoutChoice:
    layout: str  # "colocated" or "disaggregated"
    colocated_s: float | None
    disaggregated_s: float | None
    reason: str


def slowest_stage_busy_s(plan) -> float:
    """Seconds the disaggregated plan's slowest stage computes per iteration: its time per
    microbatch (`predicted["stage_time_s"]`) times the microbatches."""
    return max(plan.predicted["stage_time_s"].values()) * plan.num_microbatches


def choose_layout(colocated, disaggregated_s: float | None,
                  disaggregated_busy_s: float = 0.0) -> LayoutChoice:
    """`colocated`: a `ColocatedEvaluation` or None (does not fit); `disaggregated_s`: the
    disaggregated plan's iteration time or None; `disaggregated_busy_s`: its slowest
    stage's busy time (`slowest_stage_busy_s`). Ties go to disaggregated (the default)."""
    if colocated is None and disaggregated_s is None:
        raise PlanError("neither layout fits: add GPUs or lower the batch")
    if colocated is None:
        return LayoutChoice("disaggregated", None, disaggregated_s,
                            "the co-located layout does not fit in memory")
    c = colocated.iteration_time_s
    if disaggregated_s is None:
        return LayoutChoice("colocated", c, None, "no disaggregated plan fits")
    comp = sum(colocated.compute_s.values())
    comm = sum(colocated.exposed_comm_s.values()) + colocated.all_to_all_s
    if c < disaggregated_s:
        why = (f"co-located {seconds(c)} < disaggregated {seconds(disaggregated_s)} per iteration: "
               f"every GPU computes every phase ({seconds(comp)}) with {seconds(comm)} of exposed "
               f"collectives, while the disaggregated plan's slowest stage alone computes "
               f"{seconds(disaggregated_busy_s)} and pipeline fill, drain and gradient sync add "
               f"{seconds(max(disaggregated_s - disaggregated_busy_s, 0.0))}")
        return LayoutChoice("colocated", c, disaggregated_s, why)
    unit, worst = max(colocated.exposed_comm_s.items(), key=lambda kv: kv[1])
    why = (f"disaggregated {seconds(disaggregated_s)} <= co-located {seconds(c)} per iteration: "
           f"co-located computes {seconds(comp)} and exposes {seconds(comm)} of collectives "
           f"(largest: {unit!r} at ZeRO-{colocated.zero[unit]}, {seconds(worst)}), phases one "
           f"after another, while disaggregated units overlap on their own GPUs")
    return LayoutChoice("disaggregated", c, disaggregated_s, why)
