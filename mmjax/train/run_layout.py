"""`choose_layout`: how a run places the model, decided once at start-up: one program
(`train.plan` None), a disaggregated Plan on the pipeline runtime, or the co-located
layout (every unit on all devices, train/colocated_plan.py)."""
from __future__ import annotations

import dataclasses

import jax

from mmjax.planner.plan import Plan
from mmjax.settings import bound
from mmjax.train.auto_plan import auto_layout
from mmjax.train.colocated_plan import Colocation, check_colocated_run
from mmjax.train.data_config import layout_and_source, train_source
from mmjax.train.manual_plan import manual_plan
from mmjax.train.progress import console as progress_console


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """`plan`: `train.plan` as set (None: one program); `colocation`: the co-located
    layout's settings, or None; `chosen`: the Plan `manual_plan` or `auto_layout` already
    built for a disaggregated run (so it is not planned twice), or None."""
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


def choose_layout(plan, global_batch, cfg, tok, replan_every, trace_every,
                  trace_steps) -> RunLayout:
    """The run's layout: co-located when `--plan=manual` asks for it (`manual_plan.layout`)
    or `--plan=auto` with `auto_plan.layout` "colocated" / "auto" chooses it (the choice
    and why are one console line); else a Plan (`plan` set) or one program."""
    if plan == "manual":
        built = manual_plan(global_batch=global_batch, model=cfg)
    elif plan == "auto" and bound("auto_plan.layout", "disaggregated") != "disaggregated":
        src = layout_and_source(cfg, tok)[1]
        built, line = auto_layout(cfg, global_batch, src if src is not None
                                  else train_source(cfg))
        if jax.process_index() == 0:
            progress_console().print(line, markup=False, highlight=False)
    else:
        return RunLayout(plan)
    if not isinstance(built, Colocation):
        return RunLayout(plan, chosen=built)
    check_colocated_run(replan_every, trace_every, trace_steps)
    return RunLayout(plan, colocation=built)
