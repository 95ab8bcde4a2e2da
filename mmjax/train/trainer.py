"""`train`: the run's entry point (scripts/train.py): settings checked, the model, plan
and runner built, then the steps (train/loop.py), resumable.

Everything is gin-configurable (`train.*`, `named_model_config.*`, `OptimizerSettings.*`,
`learning_rate_schedule.*`). Writes `workdir/metrics.jsonl` (one JSON object per step) and
orbax checkpoints under `workdir/checkpoints`; on start it resumes from the newest one,
including the data position, so an interrupted run continues bit-for-bit. The two ways to
run a step (train/runner.py `Runner`): train/single_program.py (one program) and
train/pipelined.py (a Plan); train/run_setup.py builds what comes before them.
"""
from __future__ import annotations

import os

import gin
import jax
import jax.numpy as jnp

from mmjax.data.sources import eval_source
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.settings import check_bound_settings, check_train_args
from mmjax.train.auto_plan import auto_layout, run_planning_inputs
from mmjax.train.data_config import layout_and_source, train_source
from mmjax.train.startup_barrier import DEFAULT_TIMEOUT_S
from mmjax.train.loop import TrainingStopped, TrainLoop, checkpoint_now  # noqa: F401 (public)
from mmjax.train.optimizer import learning_rate_schedule
from mmjax.train.pipelined import pipelined_runner
from mmjax.train.plan_history import plan_in_effect, plan_to_resume
from mmjax.train.progress import Progress as StepProgress
from mmjax.train.progress import console as progress_console
from mmjax.train.replanning import Replanner
from mmjax.train.run_files import (compiling_line, pretrained_sources, use_compilation_cache,
                                   write_run_info)
from mmjax.train.run_report import pretrained_lines
from mmjax.train.run_setup import dry_run_build, model_and_tokenizer, prepared_plan, run_plan
from mmjax.train.single_program import SingleProgram
from mmjax.train.colocated import Colocated
from mmjax.train.colocated_data import check_colocated_loader
from mmjax.train.colocated_plan import Colocation, check_colocated_run
from mmjax.train.lora_setup import check_lora_layout
from mmjax.train.manual_plan import manual_plan
from mmjax.train.spike_guard import SpikeGuard
from mmjax.train.validate import gin_bound
from mmjax.train.validate import (check_data_path, check_replan_settings, check_train_settings,
                                  parse_trace_steps)

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
          dry_run: bool = False, startup_timeout: float = DEFAULT_TIMEOUT_S) -> list[dict]:
    """Train `model` for `steps` steps (this invocation stops early after `stop_after`
    steps, as a preemption would; a rerun resumes); returns this run's metric records.

    `plan`: None trains the whole model as one program on the default device; "manual"
    uses the gin-bound `manual_plan`; "auto" plans at start-up for the devices present
    and the run's data (train/auto_plan.py); any other value is a Plan JSON file
    (scripts/plan.py --json). A plan runs on the pipeline runtime over all devices.
    `eval_every` > 0: every that many steps (and at the end), the validation loss on the
    held-out `eval_source.*` set goes into the step's metrics as `eval_loss`.
    `attention_impl` (models/attention.py `bam_attention`: auto, dense, chunked, pallas,
    cudnn) sets every unit's attention; with a plan it replaces each unit's plan field.
    `trace_every` = N > 0 (with a plan): every N-th step runs traced and writes
    `<workdir>/traces/step_<n>.json` (model, Plan, serial trace) for scripts/replan.py.
    `trace_steps` = "A:B" (with a plan): steps A..B (1-based, inclusive) run traced and
    write those files too (scripts/train.py --trace_steps renders each as a timeline).
    `replan_every` = N > 0 (with a plan): every N-th step runs traced and the traces of the
    plan in effect re-plan the run (train/replanning.py, DistTrain §5 on measured times);
    when the new plan's predicted gain is >= `replan_min_gain`, the run checkpoints that
    step and continues under the new plan, written to `<workdir>/plans/step_<n>.json`
    (the step's metrics row gets "replanned"). A resume continues on the plan in effect at
    its checkpoint. `replanner`: an explicit `Replanner` instead of the one built from
    these settings (e.g. one that models a slower unit).

    Checkpoints: every `checkpoint_every` steps; the newest `keep_checkpoints` are kept, and
    every multiple of `keep_every` permanently. A resume takes the newest checkpoint that
    verifies (train/checkpoint.py), naming and setting aside any that do not.

    A step whose loss or gradient norm is not finite is not applied (counted in
    `nonfinite_steps`), nor one whose loss or gradient norm exceeds `spike_factor` times
    its median over the last `spike_window` applied steps (the loss-spike guard, from the
    first step: absolute limits before any step is applied, `spike_factor` x the largest
    value until half the window is filled; counted in `spike_steps`, each one logged; 0
    turns it off); `max_bad_steps` of either in a row stop the run (TrainingStopped) naming the last
    good checkpoint. A checkpoint due inside a bad streak is written at the first good step
    after it. On resume metrics.jsonl keeps only the rows up to
    the restored step, so every step appears once.

    `compilation_cache_dir`: JAX's persistent compilation cache, so a resume or any later
    run with the same programs loads them instead of compiling: "" (default) uses
    $JAX_COMPILATION_CACHE_DIR if set, else the machine's, shared by every run
    (`$XDG_CACHE_HOME/mmjax/jax-compilation`, else `~/.cache/...`); "off" disables it; any
    other value is the directory. `check_memory` (one program): stop before compiling when the step's estimated
    memory exceeds the device's (train/memory_check.py); False tries anyway.

    `startup_timeout` (seconds, multi-process): how long the processes wait for each other
    at start-up before their first collective (train/startup_barrier.py; a loaded machine
    may need minutes); past it the run stops with one line (exit 1; the launcher's
    `--max_restarts` restarts it).

    `dry_run` (scripts/train.py --check): every check above, the plan, the optimizer and
    the first global batch built, then return [] having written nothing."""
    check_train_settings(steps, global_batch, compute_dtype, _DTYPES, seed, checkpoint_every,
                         progress, stop_after, plan, keep_checkpoints, keep_every, max_bad_steps)
    check_train_args(eval_every=eval_every, attention_impl=attention_impl,
                     trace_every=trace_every, compilation_cache_dir=compilation_cache_dir,
                     replan_every=replan_every, spike_factor=spike_factor,
                     spike_window=spike_window)
    if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)) \
            or not 1 <= startup_timeout <= 86400:
        raise UserError(f"train.startup_timeout={startup_timeout!r}: must be seconds in "
                        f"[1, 86400] (how long processes wait for each other at start-up)")
    if 0 < spike_factor <= 1:
        raise UserError(f"train.spike_factor={spike_factor!r}: must be 0 (off) or > 1 (a "
                        f"step above that many times the median is held back; e.g. 100)")
    check_bound_settings(None, plan, eval_every, replan_every)  # types and ranges
    trace_range = parse_trace_steps(trace_steps, plan)
    check_replan_settings(replan_every, replan_min_gain, plan, replanner)
    check_data_path()
    cfg, tok, dirs = model_and_tokenizer(model)
    check_bound_settings(cfg.unit_names, plan, eval_every, replan_every)  # per-unit keys
    schedule = learning_rate_schedule(steps)
    dtype = _DTYPES[compute_dtype]
    colo, chosen = _colocation(plan, global_batch, cfg, tok, replan_every, trace_every,
                               trace_steps)
    check_lora_layout(cfg, plan, colo is not None, "adapter" in dirs)
    if cfg.vae is not None and (colo is not None or replan_every):
        raise UserError(f"vae.placement chose the device (a frozen VAE unit), which "
                        f"{'the co-located layout' if colo is not None else 'train.replan_every'}"
                        f" does not place: set vae.placement='host' (the data path encodes)")
    if colo is not None:  # the loader's balancing settings, as the co-located layout reads them
        lay, src = layout_and_source(cfg, tok)
        check_colocated_loader(cfg, lay, src if src is not None else train_source(cfg),
                               global_batch, jax.device_count(), colo.max_tp)
    held_out = eval_source(cfg, tok) if eval_every else None
    if eval_every and held_out is None:
        raise UserError("train.eval_every needs a held-out set: set eval_source.json_path "
                        "(a LLaVA JSON/JSONL) or eval_source.urls (WebDataset shards)")
    if attention_impl is not None:
        from mmjax.models.attention import choose_implementation

        choose_implementation(attention_impl, 1, 1, dtype)  # reject a bad name up front
    if dry_run:
        dry_run_build(cfg, tok, dirs, None if colo else plan, global_batch, attention_impl,
                      schedule, dtype, check_memory)
        return []
    # the cache as this run found it (the runner's small eager programs land in it next)
    waiting = compiling_line(use_compilation_cache(compilation_cache_dir))

    def announce() -> None:  # once the memory check passed: what the wait is, at once
        if progress and jax.process_index() == 0:
            progress_console().print(waiting, markup=False, highlight=False)

    if plan is None or colo is not None:
        the_plan = None
        layout, source = layout_and_source(cfg, tok)
        runner = (SingleProgram(cfg, layout, global_batch, schedule, dtype, seed, source,
                                attention_impl or "auto", dirs, check_memory)
                  if colo is None else Colocated(cfg, layout, global_batch, schedule, dtype,
                                                 seed, colo, source, attention_impl or "auto",
                                                 dirs, check_memory=check_memory))
        announce()
    else:
        start_plan, resumed_plan = plan, plan_to_resume(workdir, plan, progress_console())
        plan = resumed_plan[1] if resumed_plan else plan  # a re-planned run stays re-planned
        the_plan, cfg = run_plan(plan, cfg, tok, dirs, global_batch, attention_impl,
                                 chosen if plan == "auto" else None)
        layout, source = layout_and_source(cfg, tok)
        runner = pipelined_runner(cfg, layout, the_plan, schedule, dtype, seed, source, dirs,
                                  steps, check_memory, announce)
        if replan_every and replanner is None:
            hw, wl = run_planning_inputs(cfg, source if source is not None
                                         else train_source(cfg))
            replanner = Replanner(cfg, hw, wl, jax.device_count(), replan_min_gain)
    os.makedirs(workdir, exist_ok=True)
    sources = pretrained_sources(workdir, dirs)  # a resume reads what the run trained with
    if jax.process_index() == 0:  # what scripts/generate.py rebuilds the model and data from
        with open(os.path.join(workdir, "config.gin"), "w") as f:
            f.write(gin.config_str())
        write_run_info(workdir, cfg, the_plan, seed, dirs, sources)
        for line in pretrained_lines(cfg, dirs) + [runner.memory_line]:
            if line:  # pretrained: read into the runner's fresh parameters
                progress_console().print(line, markup=False, highlight=False)
    loop = TrainLoop(workdir, runner, schedule, keep_checkpoints, keep_every,
                     SpikeGuard(spike_factor, spike_window), startup_timeout)
    if the_plan is not None and plan_in_effect(workdir, loop.start) != resumed_plan:
        # the newest checkpoint was unusable and an older one predates the plan chosen above
        in_effect = plan_in_effect(workdir, loop.start)
        plan = in_effect[1] if in_effect else start_plan
        if loop.lead:
            loop.console.print(f"checkpoint step {loop.start} ran {plan}: continuing on it"
                               if loop.start else f"no usable checkpoint: starting on {plan}",
                               markup=False)
        the_plan = run_plan(plan, cfg, tok, dirs, global_batch, attention_impl)[0]
        loop.rebuild(loop.start, lambda: pipelined_runner(cfg, layout, the_plan, schedule,
                                                          dtype, seed, source, dirs, steps,
                                                          check_memory))
        if loop.lead:
            write_run_info(workdir, cfg, the_plan, seed, dirs, sources)
    if replan_every:
        loop.replanning(replanner, replan_every, the_plan, lambda p: prepared_plan(
            p, cfg, tok, dirs, global_batch, attention_impl, same_config=True),
            lambda p: pipelined_runner(cfg, layout, p, schedule, dtype, seed, source, dirs,
                                       steps, check_memory),
            lambda p: write_run_info(workdir, cfg, p, seed, dirs, sources))
    try:
        where = "one program" if plan is None else f"plan {plan} on {jax.device_count()} devices"
        where += "" if colo is None else f", co-located (llm tp {colo.tp}" + "".join(
            f", {u} tp {t}" for u, t in colo.unit_tp) + ")"
        loop.console.print(f"[bold]{cfg.name}[/]: {runner.num_trainable:,} trainable "
                           f"parameters, {steps} steps of {global_batch} samples, {where}")
        end = steps if stop_after is None else min(steps, loop.start + stop_after)
        report = StepProgress(loop.console, steps, loop.start, global_batch,
                              enabled=progress and loop.lead)
        loop.runner.progress = report
        report.preemption = loop.preempt  # a Ctrl-C during a compilation says so
        return loop.run(end, report, checkpoint_every, max_bad_steps,
                        lambda n: the_plan is not None and (
                            (trace_every > 0 and n % trace_every == 0)
                            or trace_range[0] <= n <= trace_range[1]),
                        lambda n: eval_every and (n % eval_every == 0 or n == end),
                        lambda: loop.runner.evaluate(*held_out, layout), cfg, the_plan)
    finally:
        loop.close()


def _colocation(plan, global_batch, cfg, tok, replan_every, trace_every, trace_steps):
    """(the co-located layout's settings when `--plan=manual` asks for it or `--plan=auto`
    with `auto_plan.layout` "colocated" / "auto" chooses it, else None; the Plan that
    `auto_plan.layout` "auto" chose, else None). The choice and why are one console line."""
    chosen = None
    if plan == "manual":
        colo = manual_plan(global_batch=global_batch, model=cfg)
    elif plan == "auto" and gin_bound("auto_plan.layout") and \
            gin.query_parameter("auto_plan.layout") != "disaggregated":
        src = layout_and_source(cfg, tok)[1]
        colo, line = auto_layout(cfg, global_batch, src if src is not None
                                 else train_source(cfg))
        if jax.process_index() == 0:
            progress_console().print(line, markup=False, highlight=False)
        if not isinstance(colo, Colocation):
            colo, chosen = None, colo
    else:
        colo = None
    if not isinstance(colo, Colocation):
        return None, chosen
    check_colocated_run(replan_every, trace_every, trace_steps)
    return colo, None
