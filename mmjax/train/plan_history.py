"""The plans a re-planning run switched to (`train.replan_every`): `<workdir>/plans/
step_<n>.json` is the plan in effect from step n on. A resume continues on the plan of the
checkpoint it restores, so rerunning the same command never silently changes plans."""
from __future__ import annotations

import os
import re

import jax

from mmjax.planner.plan import Plan
from mmjax.train.checkpoint import checkpoint_steps

PLANS = "plans"


def plan_path(workdir: str, step: int) -> str:
    return os.path.join(workdir, PLANS, f"step_{step}.json")


def write_plan(workdir: str, step: int, plan: Plan) -> str:
    """Save the plan in effect from `step` on; -> its path relative to `workdir`."""
    path = plan_path(workdir, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plan.save(path)
    return os.path.relpath(path, workdir)


def _steps(workdir: str) -> list[int]:
    folder = os.path.join(workdir, PLANS)
    if not os.path.isdir(folder):
        return []
    return [int(m.group(1)) for m in (re.fullmatch(r"step_(\d+)\.json", n)
                                      for n in os.listdir(folder)) if m]


def plan_in_effect(workdir: str, step: int) -> tuple[int, str] | None:
    """(k, path) of the newest `plans/step_<k>.json` with k <= `step`, or None."""
    found = [k for k in _steps(workdir) if k <= step]
    return (max(found), plan_path(workdir, max(found))) if found else None


def forget_plans_after(workdir: str, step: int) -> None:
    """Remove the plans from after `step` (a resume from `step` decides those again)."""
    for k in _steps(workdir):
        if k > step:
            os.remove(plan_path(workdir, k))


def plan_to_resume(workdir: str, plan: str, console) -> tuple[int, str] | None:
    """(k, path) of the plan in effect at the newest checkpoint, said in one line, or None
    (the run starts, or resumes, on `plan`)."""
    newest = checkpoint_steps(os.path.join(workdir, "checkpoints"))
    found = plan_in_effect(workdir, newest[0]) if newest else None
    if found is not None and jax.process_index() == 0:
        console.print(f"resuming on {found[1]}: the plan in effect from step {found[0]} "
                      f"(remove {os.path.join(workdir, PLANS)} to use train.plan={plan})",
                      markup=False)
    return found
