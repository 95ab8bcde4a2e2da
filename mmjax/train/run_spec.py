"""`RunSpec`: a run's `train.*` settings, typed and checked once where the run starts.

gin stays the user's syntax: `train.steps = 30` binds the field `steps` of the configurable
`train`, which is this dataclass. `RunSpec.from_gin(**given)` (the command-line edge,
scripts/train.py, and `trainer.train`) builds it once from the bindings, with `given`
arguments over them; its fields' defaults are the settings table's (mmjax/settings/) and
the table is its only validator. Past this point the run reads the spec, never gin.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import gin

from mmjax.errors import UserError
from mmjax.settings import SETTINGS, check

_TRAIN = SETTINGS["train"]


def _default(name: str):
    return _TRAIN[name].default


@dataclass(frozen=True)
class RunSpec:
    """The `train.*` settings (docs/design.md, "The trainer", describes each)."""
    steps: int = _default("steps")
    global_batch: int = _default("global_batch")
    compute_dtype: str = _default("compute_dtype")
    seed: int = _default("seed")
    checkpoint_every: int = _default("checkpoint_every")
    progress: bool = _default("progress")
    stop_after: int | None = _default("stop_after")
    plan: str | None = _default("plan")
    eval_every: int = _default("eval_every")
    attention_impl: str | None = _default("attention_impl")
    trace_every: int = _default("trace_every")
    keep_checkpoints: int = _default("keep_checkpoints")
    keep_every: int | None = _default("keep_every")
    max_bad_steps: int = _default("max_bad_steps")
    trace_steps: str | None = _default("trace_steps")
    compilation_cache_dir: str = _default("compilation_cache_dir")
    replan_every: int = _default("replan_every")
    replan_min_gain: float = _default("replan_min_gain")
    check_memory: bool = _default("check_memory")
    spike_factor: float = _default("spike_factor")
    spike_window: int = _default("spike_window")
    startup_timeout: float = _default("startup_timeout")
    schedule: str = _default("schedule")
    dry_run: bool = False  # set by the program (scripts/train.py --check), not by gin

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if _TRAIN[f.name].kind != "program":
                check(f"train.{f.name}", getattr(self, f.name), _TRAIN[f.name])
        if self.trace_steps is not None and self.plan is None:
            raise UserError("train.trace_steps traces the pipeline runtime's actions: add "
                            "--plan=manual (or a Plan JSON); the single program is one XLA "
                            "program (profile it with jax.profiler)")
        if self.replan_every and self.plan is None:
            raise UserError("train.replan_every re-plans the pipeline runtime: add "
                            "--plan=auto or a plan JSON (the single program has no plan to "
                            "change)")

    @classmethod
    def from_gin(cls, **given) -> "RunSpec":
        """The spec from gin's `train.*` bindings, `given` (field -> value) over them."""
        return _configured(**given)

    @property
    def trace_range(self) -> tuple[int, int]:
        """`trace_steps` "A:B" as (A, B), 1-based inclusive; None: an empty range."""
        if self.trace_steps is None:
            return (1, 0)
        a, _, b = self.trace_steps.partition(":")
        return int(a), int(b)

    def replace(self, **kw) -> "RunSpec":
        return dataclasses.replace(self, **kw)


# the gin configurable `train`: RunSpec with its fields bound by `train.*` in gin
_configured = gin.external_configurable(RunSpec, "train")
