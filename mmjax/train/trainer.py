"""`train`: the run's entry point (scripts/train.py): settings checked, the model, plan
and runner built, then the steps (train/loop.py), resumable.

Everything is gin-configurable (`train.*`, `named_model_config.*`, `OptimizerSettings.*`,
`learning_rate_schedule.*`). Writes `workdir/metrics.jsonl` (one JSON object per step) and
orbax checkpoints under `workdir/checkpoints`; on start it resumes from the newest one,
including the data position, so an interrupted run continues bit-for-bit. The sequence:
settings checked (train/run_checks.py), the model built (train/run_setup.py), the layout
chosen once (train/run_layout.py: one program, a Plan, or co-located), the Plan the run
starts on (train/run_plans.py), the runner built (train/make_runner.py: the one place),
then the loop.
"""
from __future__ import annotations

import gin
import jax
import jax.numpy as jnp

from mmjax.models.config import MLLMConfig
from mmjax.settings import check_bound_settings
from mmjax.train.data_config import layout_and_source
from mmjax.train.loop import TrainingStopped, TrainLoop, checkpoint_now  # noqa: F401 (public)
from mmjax.train.make_runner import RunnerMaker
from mmjax.train.optimizer import learning_rate_schedule
from mmjax.train.progress import Progress as StepProgress
from mmjax.train.progress import console as progress_console
from mmjax.train.replanning import Replanner
from mmjax.train.run_checks import check_run_model, check_run_settings
from mmjax.train.run_files import compiling_line, start_run_files, use_compilation_cache
from mmjax.train.run_layout import choose_layout
from mmjax.train.run_plans import PlanMaker, plan_after_resume, plan_at_start, run_replanner
from mmjax.train.run_setup import dry_run_build, model_and_tokenizer
from mmjax.train.spike_guard import SpikeGuard
from mmjax.train.startup_barrier import DEFAULT_TIMEOUT_S

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@gin.configurable
def train(workdir: str, model: MLLMConfig | None = None, steps: int = 30,
          global_batch: int = 8, compute_dtype: str = "float32", seed: int = 0,
          checkpoint_every: int = 10, progress: bool = True,
          stop_after: int | None = None, plan: str | None = None,
          eval_every: int = 0, attention_impl: str | None = None,
          trace_every: int = 0, keep_checkpoints: int = 3, keep_every: int | None = None,
          max_bad_steps: int = 5, trace_steps: str | None = None,
          compilation_cache_dir: str = "", replan_every: int = 0,
          replan_min_gain: float = 1.10, replanner: Replanner | None = None,
          check_memory: bool = True, spike_factor: float = 100.0, spike_window: int = 20,
          dry_run: bool = False, startup_timeout: float = DEFAULT_TIMEOUT_S,
          schedule: str = "1f1b") -> list[dict]:
    """Train `model` for `steps` steps (this invocation stops early after `stop_after`
    steps, as a preemption would; a rerun resumes from the newest checkpoint that
    verifies); returns this run's metric records. `plan`: None (one program), "manual",
    "auto" or a Plan JSON; `schedule`: the pipeline schedule a plan runs (schedule/named.py).
    Every setting is described in docs/design.md ("The trainer")."""
    trace_range = check_run_settings(
        steps, global_batch, compute_dtype, _DTYPES, seed, checkpoint_every, progress,
        stop_after, plan, keep_checkpoints, keep_every, max_bad_steps, eval_every,
        attention_impl, trace_every, compilation_cache_dir, replan_every, replan_min_gain,
        replanner, spike_factor, spike_window, startup_timeout, trace_steps)
    cfg, tok, dirs = model_and_tokenizer(model)
    check_bound_settings(cfg.unit_names, plan, eval_every, replan_every)  # per-unit keys
    lr, dtype = learning_rate_schedule(steps), _DTYPES[compute_dtype]
    choice = choose_layout(plan, global_batch, cfg, tok, replan_every, trace_every,
                           trace_steps)
    held_out = check_run_model(cfg, tok, dirs, plan, choice.colocation, global_batch,
                               eval_every, replan_every, attention_impl, dtype)
    if dry_run:
        dry_run_build(cfg, tok, dirs, choice.plan_to_run(), global_batch, attention_impl,
                      lr, dtype, check_memory, choice.chosen, schedule)
        return []
    # the cache as this run found it (the runner's small eager programs land in it next)
    waiting = compiling_line(use_compilation_cache(compilation_cache_dir))
    start = plan_at_start(workdir, choice,
                          PlanMaker(cfg, tok, dirs, global_batch, attention_impl))
    cfg, (layout, source) = start.maker.cfg, layout_and_source(start.maker.cfg, tok)
    make_runner = RunnerMaker(cfg, layout, source, global_batch, lr, dtype, seed, dirs,
                              steps, check_memory, attention_impl, choice.colocation, schedule)
    runner = make_runner(start.plan, lambda: _announce(waiting, progress))
    if start.plan is not None and replan_every and replanner is None:
        replanner = run_replanner(cfg, source, replan_min_gain)
    write_info = start_run_files(workdir, cfg, start.plan, seed, dirs, runner.memory_line)
    loop = TrainLoop(workdir, runner, lr, keep_checkpoints, keep_every,
                     SpikeGuard(spike_factor, spike_window), startup_timeout)
    plan, the_plan = plan_after_resume(loop, workdir, choice, start, make_runner, write_info)
    if replan_every:
        loop.replanning(replanner, replan_every, the_plan, start.maker.prepare, make_runner,
                        write_info)
    try:
        loop.console.print(f"[bold]{cfg.name}[/]: {runner.num_trainable:,} trainable "
                           f"parameters, {steps} steps of {global_batch} samples, "
                           f"{choice.where(plan)}")
        end = steps if stop_after is None else min(steps, loop.start + stop_after)
        report = _progress(loop, steps, global_batch, progress)
        return loop.run(end, report, checkpoint_every, max_bad_steps,
                        traced_steps(the_plan, trace_every, trace_range),
                        lambda n: eval_every and (n % eval_every == 0 or n == end),
                        lambda: loop.runner.evaluate(*held_out, layout), cfg, the_plan)
    finally:
        loop.close()


def _progress(loop: TrainLoop, steps: int, global_batch: int, progress: bool) -> StepProgress:
    """The step lines' reporter, on the loop's runner (a Ctrl-C during a compilation says so)."""
    report = StepProgress(loop.console, steps, loop.start, global_batch,
                          enabled=progress and loop.lead)
    loop.runner.progress = report
    report.preemption = loop.preempt
    return report


def _announce(waiting: str, progress: bool) -> None:
    """Once the memory check passed: what the wait is, at once."""
    if progress and jax.process_index() == 0:
        progress_console().print(waiting, markup=False, highlight=False)


def traced_steps(the_plan, trace_every: int, trace_range: tuple[int, int]):
    """Whether step n runs traced: with a Plan, every `trace_every`-th step and the steps
    of `train.trace_steps`."""
    return lambda n: the_plan is not None and (
        (trace_every > 0 and n % trace_every == 0) or trace_range[0] <= n <= trace_range[1])
