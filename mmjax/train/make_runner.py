"""`RunnerMaker`: the one place a run builds its runner (train/runner.py `Runner`), at
start-up, after a resume onto an older plan and at each re-planning switch: the pipelined
runner for a Plan, else the whole-model runner on its placement (one device, or the
co-located mesh)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan
from mmjax.train.colocated import ColocatedMesh
from mmjax.train.colocated_plan import Colocation
from mmjax.train.pipelined import pipelined_runner
from mmjax.train.placement import Placement
from mmjax.train.runner import Runner
from mmjax.train.single_program import OneDevice
from mmjax.train.whole_model import WholeModelRunner


@dataclasses.dataclass(frozen=True)
class RunnerMaker:
    """What every runner of a run shares: the model config, the data layout and source,
    the learning-rate schedule, dtype, seed, pretrained dirs and the run's settings."""
    cfg: MLLMConfig
    layout: Any
    source: Any
    global_batch: int
    schedule: Callable
    dtype: Any
    seed: int
    dirs: dict
    steps: int
    check_memory: bool
    attention_impl: str | None
    colocation: Colocation | None
    pipeline_schedule: str = "1f1b"  # `train.schedule` (schedule/named.py)

    def __call__(self, plan: Plan | None = None, announce=None) -> Runner:
        """The runner for `plan` (None: the whole model on `placement()`); `announce()` once
        the memory check passed (the trainer's line saying what compiles)."""
        if plan is not None:
            return pipelined_runner(self.cfg, self.layout, plan, self.schedule, self.dtype,
                                    self.seed, self.source, self.dirs, self.steps,
                                    self.check_memory, announce, self.pipeline_schedule)
        runner = WholeModelRunner(self.cfg, self.layout, self.global_batch, self.schedule,
                                  self.dtype, self.seed, self.placement(), self.source,
                                  self.attention_impl or "auto", self.dirs, self.check_memory)
        if announce is not None:
            announce()
        return runner

    def placement(self) -> Placement:
        """Where the whole model runs: one device, or the co-located mesh of every device."""
        if self.colocation is None:
            return OneDevice()
        return ColocatedMesh(self.colocation, self.cfg, self.dtype)
