"""`train`: the run's entry point (scripts/train.py): settings checked, the model, plan
and runner built, then the steps (train/loop.py), resumable.

Everything is gin-configurable (`train.*`: the run spec, train/run_spec.py;
`named_model_config.*`, `OptimizerSettings.*`, `learning_rate_schedule.*`). Writes `workdir/metrics.jsonl` (one JSON object per step) and
orbax checkpoints under `workdir/checkpoints`; on start it resumes from the newest one,
including the data position, so an interrupted run continues bit-for-bit. The sequence:
settings checked (train/run_checks.py), the model built (train/run_setup.py), the layout
chosen once (train/run_plans.py: one program, a Plan, or co-located), the Plan the run
starts on (train/run_plans.py), the runner built (train/make_runner.py: the one place),
then the loop.
"""
from __future__ import annotations

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
from mmjax.train.run_plans import (PlanMaker, choose_layout, plan_after_resume, plan_at_start,
                                   run_replanner)
from mmjax.train.run_setup import dry_run_build, model_and_tokenizer
from mmjax.train.run_spec import RunSpec
from mmjax.train.spike_guard import SpikeGuard

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}  # settings.COMPUTE_DTYPES


def train(workdir: str, model: MLLMConfig | None = None, spec: RunSpec | None = None,
          replanner: Replanner | None = None, **settings) -> list[dict]:
    """Train `model` for `spec.steps` steps (this invocation stops early after
    `spec.stop_after` steps, as a preemption would; a rerun resumes from the newest
    checkpoint that verifies); returns this run's metric records. `spec`: the run's
    settings (default: `RunSpec.from_gin()`); `settings`: fields over it. `spec.plan`: None
    (one program), "manual", "auto" or a Plan JSON; `spec.schedule`: the pipeline schedule a
    plan runs (schedule/named.py). docs/design.md ("The trainer")."""
    s = spec.replace(**settings) if spec is not None else RunSpec.from_gin(**settings)
    check_run_settings(s, replanner)
    cfg, tok, dirs = model_and_tokenizer(model)
    check_bound_settings(cfg.unit_names, s.plan, s.eval_every, s.replan_every)  # per unit
    lr, dtype = learning_rate_schedule(s.steps), _DTYPES[s.compute_dtype]
    choice = choose_layout(s.plan, s.global_batch, cfg, tok, s.replan_every, s.trace_every,
                           s.trace_steps)
    held_out = check_run_model(cfg, tok, dirs, s.plan, choice.colocation, s.global_batch,
                               s.eval_every, s.replan_every, s.attention_impl, dtype)
    if s.dry_run:
        dry_run_build(cfg, tok, dirs, choice.plan_to_run(), s.global_batch, s.attention_impl,
                      lr, dtype, s.check_memory, choice.chosen, s.schedule)
        return []
    # the cache as this run found it (the runner's small eager programs land in it next)
    waiting = compiling_line(use_compilation_cache(s.compilation_cache_dir))
    start = plan_at_start(workdir, choice,
                          PlanMaker(cfg, tok, dirs, s.global_batch, s.attention_impl))
    cfg, (layout, source) = start.maker.cfg, layout_and_source(start.maker.cfg, tok)
    make_runner = RunnerMaker(cfg, layout, source, s.global_batch, lr, dtype, s.seed,
                              dirs, s.steps, s.check_memory, s.attention_impl,
                              choice.colocation, s.schedule)
    runner = make_runner(start.plan, lambda: _announce(waiting, s.progress))
    if start.plan is not None and s.replan_every and replanner is None:
        replanner = run_replanner(cfg, source, s.replan_min_gain)
    write_info = start_run_files(workdir, cfg, start.plan, s.seed, dirs, runner.memory_line)
    loop = TrainLoop(workdir, runner, lr, s.keep_checkpoints, s.keep_every,
                     SpikeGuard(s.spike_factor, s.spike_window), s.startup_timeout)
    plan, the_plan = plan_after_resume(loop, workdir, choice, start, make_runner, write_info)
    if s.replan_every:
        loop.replanning(replanner, s.replan_every, the_plan, start.maker.prepare, make_runner,
                        write_info)
    try:
        loop.console.print(f"[bold]{cfg.name}[/]: {runner.num_trainable:,} trainable "
                           f"parameters, {s.steps} steps of {s.global_batch} samples, "
                           f"{choice.where(plan)}")
        end = s.steps if s.stop_after is None else min(s.steps, loop.start + s.stop_after)
        report = _progress(loop, s.steps, s.global_batch, s.progress)
        return loop.run(end, report, s.checkpoint_every, s.max_bad_steps,
                        traced_steps(the_plan, s.trace_every, s.trace_range),
                        lambda n: s.eval_every and (n % s.eval_every == 0 or n == end),
                        lambda: loop.runner.evaluate(held_out[0], held_out[1], layout), cfg,
                        the_plan)
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
