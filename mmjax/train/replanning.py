"""`train.replan_every`: re-plan a running job from its measured step times (DistTrain §5
on the measured profile of planner/measured.py instead of the analytic one). A
`Replanner` holds what the planner needs besides the plan and its trace (the model,
the hardware, the workload, the device count) and the gain a switch must promise; the
trainer asks it between steps and, on a new plan, continues from a checkpoint under it
(checkpoints are plan-independent, train/logical_state.py)."""
from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from mmjax.planner.measured import replan
from mmjax.planner.plan import Plan
from mmjax.train.validate import check_min_gain


@dataclasses.dataclass
class Replanner:
    model: object  # MLLMConfig
    hardware: object  # planner Hardware: the analytic prior
    workload: object  # planner Workload: samples of the run's source
    num_devices: int
    min_gain: float = 1.10
    prior_actions: float = 4.0  # weight of the analytic model, in traced actions

    def __post_init__(self):
        check_min_gain(self.min_gain)

    def measured_trace(self, plan: Plan, trace: list[dict]) -> list[dict]:
        """The trace the decision learns from: the runtime's own (a subclass may model
        another machine, e.g. one unit slower)."""
        return trace

    def decide(self, plan: Plan, trace: list[dict]) -> tuple[Plan, float] | None:
        """(the planner's plan on the measured profile, its predicted gain) when the gain
        is at least `min_gain` and the plan differs from `plan`; else None."""
        res = replan(self.model, plan, self.measured_trace(plan, trace), self.hardware,
                     self.num_devices, self.workload, self.prior_actions)
        if res.gain < self.min_gain or _shape(res.plan) == _shape(plan):
            return None
        return res.plan, res.gain


def _shape(plan: Plan):
    return (plan.num_microbatches, tuple((u.name, u.dp, u.tp, u.pp, u.cp, u.layers,
                                          u.num_chunks) for u in plan.units))


def from_process_0(text: str | None) -> str | None:
    """Process 0's `text` on every process (one decision for all), broadcast as the uint8
    bytes of its JSON (never empty); single process: `text` itself."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(text).encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.int32(data.size)))
    buf = data if jax.process_index() == 0 else np.zeros(size, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
    return json.loads(got.tobytes().decode())


def decision_json(decision: tuple[Plan, float] | None) -> str | None:
    return None if decision is None else json.dumps(
        {"plan": decision[0].to_json(), "gain": decision[1]})


def decision_from_json(text: str | None) -> tuple[Plan, float] | None:
    if text is None:
        return None
    d = json.loads(text)
    return Plan.from_json(d["plan"]), float(d["gain"])


def switch_line(step: int, old: Plan, new: Plan, gain: float, where: str) -> str:
    """One console line: each changed unit's dp/tp/pp/layers before -> after, the gain,
    the plan's file."""
    knobs = lambda u: f"dp={u.dp} tp={u.tp} pp={u.pp} layers={list(u.layers)}"
    changed = [f"{u.name} {knobs(old.unit(u.name))} -> {knobs(u)}" for u in new.units
               if knobs(u) != knobs(old.unit(u.name))]
    same = [u.name for u in new.units if knobs(u) == knobs(old.unit(u.name))]
    mbs = (f"; microbatches {old.num_microbatches} -> {new.num_microbatches}"
           if old.num_microbatches != new.num_microbatches else "")
    return (f"step {step}: re-planned (predicted gain {gain:.3f}x): " + "; ".join(changed)
            + (f"; {', '.join(same)} unchanged" if same else "") + mbs + f" -> {where}")
