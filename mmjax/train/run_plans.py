"""The run's layout, chosen once (`choose_layout`: `manual_plan` or `auto_plan` builds it,
a Plan JSON or no plan is named as set), and the Plan a disaggregated run trains on: at
start-up the one in effect at the newest checkpoint (a re-planned run stays re-planned, train/plan_history.py), and after the
resume, when that checkpoint proved unusable, the one in effect at the checkpoint the run
actually restored."""
from __future__ import annotations

import dataclasses

import jax

from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan
from mmjax.train.auto_plan import auto_plan, run_planning_inputs
from mmjax.train.colocated_plan import check_colocated_run
from mmjax.train.data_config import layout_and_source, train_source
from mmjax.train.manual_plan import manual_plan
from mmjax.train.plan_history import plan_in_effect, plan_to_resume
from mmjax.train.progress import console as progress_console
from mmjax.train.replanning import Replanner
from mmjax.train.run_layout import RunLayout
from mmjax.train.run_setup import prepared_plan, run_plan


def choose_layout(plan: str | None, global_batch: int, cfg: MLLMConfig, tok, replan_every: int,
                  trace_every: int, trace_steps) -> RunLayout:
    """The run's layout: `--plan=manual` and `--plan=auto` build theirs (a Plan or the
    co-located layout: `manual_plan.layout` acts in train/manual_plan.py, `auto_plan.layout`
    in train/auto_plan.py, whose line saying what it chose is printed); a Plan JSON or
    no plan (one program) as named."""
    if plan == "manual":
        chosen = manual_plan(global_batch=global_batch, model=cfg)
    elif plan == "auto":  # planned for the source this run reads
        source = layout_and_source(cfg, tok)[1]
        chosen, line = auto_plan(cfg, global_batch,
                                 source if source is not None else train_source(cfg))
        if jax.process_index() == 0:
            progress_console().print(line, markup=False, highlight=False)
    else:
        return RunLayout(plan)
    if chosen.colocation is not None:
        check_colocated_run(replan_every, trace_every, trace_steps)
    return chosen


@dataclasses.dataclass(frozen=True)
class PlanMaker:
    """What turns a plan name, or a new Plan, into the run's validated Plan."""
    cfg: MLLMConfig
    tok: object
    dirs: dict
    global_batch: int
    attention_impl: str | None

    def build(self, plan: str, chosen: Plan | None = None) -> tuple[Plan, MLLMConfig]:
        """`run_setup.run_plan` for this run: (`chosen`, else the Plan JSON `plan`, its
        config)."""
        return run_plan(plan, self.cfg, self.tok, self.dirs, self.global_batch,
                        self.attention_impl, chosen)

    def prepare(self, plan: Plan) -> tuple[Plan, MLLMConfig]:
        """A Plan to switch to (re-planning), validated for the config the run trains."""
        return prepared_plan(plan, self.cfg, self.tok, self.dirs, self.global_batch,
                             self.attention_impl, same_config=True)


@dataclasses.dataclass(frozen=True)
class StartPlan:
    """`name`: the plan the run starts on (`train.plan`, or the re-planned one it resumes
    on); `resumed`: `plan_to_resume`'s (step, path) or None; `plan`: the built Plan (None:
    no Plan, one program or co-located); `maker`: the PlanMaker for the run's config."""
    name: str | None
    resumed: tuple[int, str] | None
    plan: Plan | None
    maker: PlanMaker


def plan_at_start(workdir: str, choice: RunLayout, maker: PlanMaker) -> StartPlan:
    """The Plan a disaggregated run starts on (none for one program or co-located)."""
    if not choice.pipelined:
        return StartPlan(choice.plan, None, None, maker)
    assert choice.plan is not None  # pipelined
    resumed = plan_to_resume(workdir, choice.plan, progress_console())
    name = resumed[1] if resumed else choice.plan  # a re-planned run stays re-planned
    the_plan, cfg = maker.build(name, choice.chosen if name == choice.plan else None)
    return StartPlan(name, resumed, the_plan, dataclasses.replace(maker, cfg=cfg))


def plan_after_resume(loop, workdir: str, choice: RunLayout, start: StartPlan, make_runner,
                      write_info) -> tuple[str | None, Plan | None]:
    """(plan name, Plan) the run continues on after `loop` restored its checkpoint: when
    the newest checkpoint was unusable and an older one predates the plan chosen at
    start, the plan in effect at that older one (the runner rebuilt, run.json rewritten)."""
    if start.plan is None or plan_in_effect(workdir, loop.start) == start.resumed:
        return start.name, start.plan
    in_effect = plan_in_effect(workdir, loop.start)
    assert choice.plan is not None  # start.plan is set only on a pipelined run
    name = in_effect[1] if in_effect else choice.plan
    if loop.lead:
        loop.console.print(f"checkpoint step {loop.start} ran {name}: continuing on it"
                           if loop.start else f"no usable checkpoint: starting on {name}",
                           markup=False)
    the_plan = start.maker.build(name, choice.chosen if name == choice.plan else None)[0]
    loop.rebuild(loop.start, lambda: make_runner(the_plan))
    if loop.lead:
        write_info(the_plan)
    return name, the_plan


def run_replanner(cfg: MLLMConfig, source, min_gain: float) -> Replanner:
    """The `Replanner` built from the run's settings (`train.replan_every`): the planner's
    hardware and workload inputs for the run's source, `min_gain` its threshold."""
    hw, wl = run_planning_inputs(cfg, source if source is not None else train_source(cfg))
    return Replanner(cfg, hw, wl, jax.device_count(), min_gain)
