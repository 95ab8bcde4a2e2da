"""`RunLayout`: how a run places the model, decided once at start-up (train/run_plans.py
`choose_layout`): one program (`train.plan` None), a disaggregated Plan on the pipeline
runtime, or the co-located layout (every unit on all devices, train/colocated_plan.py)."""
from __future__ import annotations

import dataclasses

import jax

from mmjax.planner.plan import Plan
from mmjax.train.colocated_plan import Colocation


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """`plan`: `train.plan` as set (None: one program); `colocation`: the co-located
    layout's settings, or None; `chosen`: the disaggregated Plan `manual_plan` or
    `auto_plan` built (so it is not planned twice), or None."""
    plan: str | None
    colocation: Colocation | None = None
    chosen: Plan | None = None

    @property
    def pipelined(self) -> bool:
        """A Plan on the pipeline runtime (else one program, on one device or co-located)."""
        return self.plan is not None and self.colocation is None

    def plan_to_run(self) -> str | None:
        """The `plan` a Plan is built from (None: no Plan: one program or co-located)."""
        return self.plan if self.pipelined else None

    def where(self, plan: str | None) -> str:
        """Where the run trains, for its first console line (`plan`: the one in effect)."""
        where = "one program" if plan is None else f"plan {plan} on {jax.device_count()} devices"
        colo = self.colocation
        return where + ("" if colo is None else f", co-located (llm tp {colo.tp}" + "".join(
            f", {u} tp {t}" for u, t in colo.unit_tp) + ")")
