"""The training loop: data -> step -> metrics -> async checkpoints, resumable.

Everything is gin-configurable (`train.*`, `named_model_config.*`, `OptimizerSettings.*`,
`learning_rate_schedule.*`). Writes `workdir/metrics.jsonl` (one JSON object per step) and
orbax checkpoints under `workdir/checkpoints`; on start it resumes from the newest one,
including the data position, so an interrupted run continues bit-for-bit. The two ways to
run a step: train/single_program.py (one program) and train/pipelined.py (a Plan).
"""
from __future__ import annotations

import dataclasses
import json
import os

import gin
import jax
import jax.numpy as jnp

from mmjax.data.sources import eval_source
from mmjax.data.tokenizer import tokenizer
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.models.hf.pretrained import expand_whole_model, prepare_pretrained
from mmjax.planner.plan import Plan
from mmjax.train.auto_plan import auto_plan, run_planning_inputs
from mmjax.train.checkpoint import Checkpointer, NonFiniteState
from mmjax.train.compile_watch import CompileWatch, watched_step
from mmjax.train.config import named_model_config, pretrained
from mmjax.train.data_config import fit_vocab, layout_and_source, train_source
from mmjax.train.optimizer import learning_rate_schedule
from mmjax.train.pipelined import Pipelined, write_trace
from mmjax.train.bad_data import too_much_bad_data
from mmjax.train.preemption import Preempted, Preemption
from mmjax.train.spike_guard import SpikeGuard
from mmjax.train.plan_history import (forget_plans_after, plan_in_effect, plan_path,
                                      plan_to_resume, write_plan)
from mmjax.train.progress import Progress as StepProgress
from mmjax.train.progress import console as progress_console
from mmjax.train.replanning import (Replanner, decision_from_json, decision_json,
                                    from_process_0, switch_line)
from mmjax.train.loss_plot import plot_workdir
from mmjax.train.run_files import (pretrained_sources, truncate_metrics,
                                   use_compilation_cache, write_run_info)
from mmjax.train.run_report import SkipReport, pretrained_lines
from mmjax.train.single_program import SingleProgram
from mmjax.train.colocated import Colocated
from mmjax.train.colocated_plan import Colocation, check_colocated_run
from mmjax.settings import check_bound_settings, check_train_args
from mmjax.train.validate import (check_data_path, check_pretrained_vocab, check_replan_settings,
                                  check_train_settings, parse_trace_steps)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def checkpoint_now(due: bool, in_a_row: int, owed: bool) -> tuple[bool, bool]:
    """(save this step, a checkpoint still owed): a step in a bad streak changed no
    parameters and is not saved; a checkpoint that fell due inside the streak is written at
    the first good step after it, so a recovered streak never costs a checkpoint."""
    save = not in_a_row and (due or owed)
    return save, (owed or due) and not save


class TrainingStopped(RuntimeError):
    """Training cannot usefully continue (one-line reason; checkpoints are intact)."""


def _last_good(ckpt) -> str:
    ckpt.wait()
    step = ckpt.latest_step()
    return f"step {step} in {ckpt.directory}" if step is not None else "none yet"


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
          dry_run: bool = False) -> list[dict]:
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
    its median over the last `spike_window` applied steps (the loss-spike guard, judged
    once half the window is filled; counted in `spike_steps`, each one logged; 0 turns it
    off); `max_bad_steps` of either in a row stop the run (TrainingStopped) naming the last
    good checkpoint. A checkpoint due inside a bad streak is written at the first good step
    after it. On resume metrics.jsonl keeps only the rows up to
    the restored step, so every step appears once.

    `compilation_cache_dir`: JAX's persistent compilation cache, so a resume or rerun loads
    its programs instead of compiling them: "" (default) uses $JAX_COMPILATION_CACHE_DIR if
    set, else `<workdir>/compilation_cache`; "off" disables it; any other value is the
    directory. `check_memory` (one program): stop before compiling when the step's estimated
    memory exceeds the device's (train/memory_check.py); False tries anyway.

    `dry_run` (scripts/train.py --check): every check above, the plan, the optimizer and
    the first global batch built, then return [] having written nothing."""
    check_train_settings(steps, global_batch, compute_dtype, _DTYPES, seed, checkpoint_every,
                         progress, stop_after, plan, keep_checkpoints, keep_every, max_bad_steps)
    check_train_args(eval_every=eval_every, attention_impl=attention_impl,
                     trace_every=trace_every, compilation_cache_dir=compilation_cache_dir,
                     replan_every=replan_every, spike_factor=spike_factor,
                     spike_window=spike_window)
    if 0 < spike_factor <= 1:
        raise UserError(f"train.spike_factor={spike_factor!r}: must be 0 (off) or > 1 (a "
                        f"step above that many times the median is held back; e.g. 100)")
    check_bound_settings(None, plan, eval_every, replan_every)  # types and ranges
    trace_range = parse_trace_steps(trace_steps, plan)
    check_replan_settings(replan_every, replan_min_gain, plan, replanner)
    check_data_path()
    cfg, tok, dirs = _model_and_tokenizer(model)
    check_bound_settings(cfg.unit_names, plan, eval_every, replan_every)  # per-unit keys
    schedule = learning_rate_schedule(steps)
    dtype = _DTYPES[compute_dtype]
    colo = _colocation(plan, global_batch, cfg, replan_every, trace_every, trace_steps)
    held_out = eval_source(cfg, tok) if eval_every else None
    if eval_every and held_out is None:
        raise UserError("train.eval_every needs a held-out set: set eval_source.json_path "
                        "(a LLaVA JSON/JSONL) or eval_source.urls (WebDataset shards)")
    if attention_impl is not None:
        from mmjax.models.attention import choose_implementation

        choose_implementation(attention_impl, 1, 1, dtype)  # reject a bad name up front
    if dry_run:
        _dry_run(cfg, tok, dirs, None if colo else plan, global_batch, attention_impl, schedule)
        return []
    use_compilation_cache(workdir, compilation_cache_dir)
    if plan is None or colo is not None:
        the_plan = None
        layout, source = layout_and_source(cfg, tok)
        runner = (SingleProgram(cfg, layout, global_batch, schedule, dtype, seed, source,
                                attention_impl or "auto", dirs, steps, check_memory)
                  if colo is None else Colocated(cfg, layout, global_batch, schedule, dtype,
                                                 seed, colo, source, attention_impl or "auto",
                                                 dirs, steps))
    else:
        start_plan, resumed_plan = plan, plan_to_resume(workdir, plan, progress_console())
        plan = resumed_plan[1] if resumed_plan else plan  # a re-planned run stays re-planned
        the_plan, cfg = _the_plan(plan, cfg, tok, dirs, global_batch, attention_impl)
        layout, source = layout_and_source(cfg, tok)
        runner = Pipelined(cfg, layout, the_plan, schedule, dtype, seed, source, dirs, steps,
                           check_memory)
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
        for line in pretrained_lines(cfg, dirs) + [getattr(runner, "memory_line", None)]:
            if line:  # pretrained: read into the runner's fresh parameters
                progress_console().print(line, markup=False, highlight=False)
    loop = _Loop(workdir, runner, schedule, keep_checkpoints, keep_every,
                 SpikeGuard(spike_factor, spike_window))
    if the_plan is not None and plan_in_effect(workdir, loop.start) != resumed_plan:
        # the newest checkpoint was unusable and an older one predates the plan chosen above
        in_effect = plan_in_effect(workdir, loop.start)
        plan = in_effect[1] if in_effect else start_plan
        if loop.lead:
            loop.console.print(f"checkpoint step {loop.start} ran {plan}: continuing on it"
                               if loop.start else f"no usable checkpoint: starting on {plan}",
                               markup=False)
        the_plan = _the_plan(plan, cfg, tok, dirs, global_batch, attention_impl)[0]
        loop.rebuild(loop.start, lambda: Pipelined(cfg, layout, the_plan, schedule, dtype,
                                                   seed, source, dirs, steps,
                                                   check_memory))
        if loop.lead:
            write_run_info(workdir, cfg, the_plan, seed, dirs, sources)
    if replan_every:
        loop.replanning(replanner, replan_every, the_plan, lambda p: _prepared(
            p, cfg, tok, dirs, global_batch, attention_impl, same_config=True),
            lambda p: Pipelined(cfg, layout, p, schedule, dtype, seed, source, dirs, steps,
                                check_memory),
            lambda p: write_run_info(workdir, cfg, p, seed, dirs, sources))
    try:
        where = "one program" if plan is None else f"plan {plan} on {jax.device_count()} devices"
        where += "" if colo is None else f", co-located (llm tp {colo.tp})"
        loop.console.print(f"[bold]{cfg.name}[/]: {runner.num_trainable:,} trainable "
                           f"parameters, {steps} steps of {global_batch} samples, {where}")
        end = steps if stop_after is None else min(steps, loop.start + stop_after)
        report = StepProgress(loop.console, steps, loop.start, global_batch,
                              enabled=progress and loop.lead)
        loop.runner.progress = report
        return loop.run(end, report, checkpoint_every, max_bad_steps,
                        lambda n: the_plan is not None and (
                            (trace_every > 0 and n % trace_every == 0)
                            or trace_range[0] <= n <= trace_range[1]),
                        lambda n: eval_every and (n % eval_every == 0 or n == end),
                        lambda: loop.runner.evaluate(*held_out, layout), cfg, the_plan)
    finally:
        loop.close()


def _colocation(plan, global_batch, cfg, replan_every, trace_every, trace_steps):
    """The co-located layout's settings when `--plan=manual` asks for it, else None."""
    from mmjax.train.pipeline_step import manual_plan

    colo = manual_plan(global_batch=global_batch, model=cfg) if plan == "manual" else None
    if not isinstance(colo, Colocation):
        return None
    check_colocated_run(replan_every, trace_every, trace_steps)
    return colo


def _dry_run(cfg, tok, dirs, plan, global_batch, attention_impl, schedule) -> None:
    """What a run builds before its first step, short of parameters and programs: the
    plan, the optimizer, the data source and the first global batch (selected, decoded,
    assembled), so a setting that would break them fails here."""
    from mmjax.data.loader import Loader
    from mmjax.train.optimizer import optimizer_from_settings

    optimizer_from_settings(schedule)
    float(schedule(0))
    the_plan = (_the_plan(plan, cfg, tok, dirs, global_batch, attention_impl)[0]
                if plan is not None else Plan.uniform(cfg, global_batch, 1))
    layout, source = layout_and_source(cfg, tok)
    loader = Loader(source if source is not None else train_source(cfg), cfg, the_plan,
                    layout)
    try:
        loader.builder(0)
    finally:
        loader.close()


def _model_and_tokenizer(model: MLLMConfig | None):
    """(model config, tokenizer or None, pretrained dirs): the gin-named model, its sizes
    from the pretrained checkpoints' config.json, its vocabulary covering the tokenizer."""
    cfg = model or named_model_config()
    # gin: pretrained.<unit> = "/hf/checkpoint/dir"; pretrained.model: a whole checkpoint
    dirs = expand_whole_model(pretrained())
    if dirs:  # configs from config.json; files, names and shapes checked before any work
        cfg = prepare_pretrained(cfg, dirs)
    tok = tokenizer()
    if tok is not None:
        cfg = fit_vocab(cfg, tok, pretrained="llm" in dirs or "model" in dirs)
    check_pretrained_vocab(cfg, dirs)
    return cfg, tok, dirs


def _the_plan(plan: str, cfg: MLLMConfig, tok, dirs: dict, global_batch: int,
              attention_impl: str | None) -> tuple[Plan, MLLMConfig]:
    """The run's Plan ("manual": gin's `manual_plan`; "auto": planned for the devices present
    and the run's source; else a Plan JSON), validated, and the config its tp sizes need."""
    from mmjax.train.pipeline_step import manual_plan

    if plan == "manual":
        the_plan = manual_plan(global_batch=global_batch, model=cfg)
    elif plan == "auto":  # planned for the source this run reads
        real = layout_and_source(cfg, tok)[1]
        the_plan = auto_plan(cfg, global_batch, real if real is not None else train_source(cfg))
        progress_console().print("auto plan: " + "; ".join(
            f"{u.name} dp={u.dp} tp={u.tp} pp={u.pp}" for u in the_plan.units))
    else:
        the_plan = Plan.load(plan)
    return _prepared(the_plan, cfg, tok, dirs, global_batch, attention_impl)


def _prepared(the_plan: Plan, cfg: MLLMConfig, tok, dirs: dict, global_batch: int,
              attention_impl: str | None, same_config: bool = False):
    """`the_plan` validated for the run, and the config its tp sizes need (`same_config`:
    a plan to switch to must train the running config, e.g. the same padded vocabulary)."""
    if the_plan.global_batch != global_batch:
        raise UserError(f"plan global_batch={the_plan.global_batch} differs from "
                        f"train.global_batch={global_batch}: make them equal")
    if tok is not None:
        fitted = fit_vocab(cfg, tok, [u.tp for u in the_plan.units],
                           pretrained="llm" in dirs or "model" in dirs)
        if same_config and fitted != cfg:
            raise UserError(f"the plan's tp sizes need vocab_size {fitted.llm.vocab_size}, "
                            f"the run trains {cfg.llm.vocab_size}")
        cfg = fitted
    if attention_impl is not None:
        the_plan = dataclasses.replace(the_plan, units=tuple(
            dataclasses.replace(u, attention_impl=attention_impl) for u in the_plan.units))
    the_plan.validate(cfg, jax.device_count())
    check_pretrained_vocab(cfg, dirs)
    return the_plan, cfg


class _Loop:
    """One invocation's steps: resume from the newest good checkpoint, then per step the
    metrics row, the skipped samples, the non-finite guard and the checkpoint. Multi-process
    (mmjax.launch): every process runs it; process 0 writes the metrics; every process
    writes the checkpoint shards it holds (orbax multi-host, one commit)."""

    def __init__(self, workdir: str, runner, schedule, keep: int, keep_every: int | None,
                 spikes: SpikeGuard | None = None):
        self.workdir, self.runner, self.schedule = workdir, runner, schedule
        self.spikes = spikes or SpikeGuard(0.0, 20)
        self.owed = False  # a checkpoint fell due inside a bad streak
        self.lead = jax.process_index() == 0
        self.console = console = progress_console()
        self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep, keep_every,
                                 log=lambda m: console.print(m, markup=False) if self.lead
                                 else None)
        if jax.process_count() > 1 and self.lead:
            console.print(f"{jax.process_count()} processes: metrics from process 0, "
                          "checkpoints from all")
        self.start, self.skipped, self.nonfinite, self.in_a_row = 0, 0, 0, 0
        self.plotted = None  # the last step in loss.png
        self.spike_steps = 0
        self.replan_every, self.plan, self.plan_traces = 0, None, []
        # from here a SIGTERM / SIGINT waits for a step boundary (restore and compile
        # included: the run then stops before its first step, nothing lost)
        self.preempt = Preemption(self.lead).__enter__()
        try:
            found = self.ckpt.restore_latest(
                getattr(runner, "restore_target", runner.checkpoint_tree)())
        except BaseException:
            self.preempt.__exit__(None, None, None)
            raise
        if found is not None:
            latest, state, data_state = found
            runner.load(state, data_state, latest)
            self.start, self.skipped = latest, int(data_state.get("skipped_samples", 0))
            self.nonfinite = int(data_state.get("nonfinite_steps", 0))
            self.spike_steps = int(data_state.get("spike_steps", 0))
            self.spikes.restore(data_state.get("spike_history", []))
            console.print(f"resumed from {workdir}/checkpoints step {latest}")
        elif self.ckpt.set_aside and self.lead:
            console.print(f"no usable checkpoint in {workdir}/checkpoints (set aside: steps "
                          f"{self.ckpt.set_aside}): starting from step 0", markup=False)
        self.metrics_path = os.path.join(workdir, "metrics.jsonl")
        self.skipped_path = os.path.join(workdir, "skipped.jsonl")
        if self.lead:
            truncate_metrics(self.metrics_path, self.start)
            truncate_metrics(self.skipped_path, self.start, one_per_step=False)
            forget_plans_after(workdir, self.start)  # decisions the checkpoints lost

    def replanning(self, replanner, every: int, plan, prepare, build, record_plan) -> None:
        """Every `every` steps, `replanner` decides (on process 0, from the traces of the
        plan in effect since it started); a new plan, `prepare`d for the run, is saved under
        plans/ and the run continues from that step's checkpoint on `build(plan)`."""
        self.replanner, self.replan_every, self.plan = replanner, every, plan
        self.prepare, self.build, self.record_plan = prepare, build, record_plan

    def run(self, end: int, report, checkpoint_every: int, max_bad_steps: int, traced,
            evaluate_at, evaluate, cfg, plan) -> list[dict]:
        records = []
        self.plan = self.plan or plan
        skips = SkipReport(report.say, self.skipped_path)
        preempt = self.preempt
        preempt.step = self.start
        if self.start < end and preempt.requested():  # a signal during start-up
            self.ckpt.wait()
            raise Preempted(preempt.signame or "a peer's signal", self.start,
                            self.ckpt.latest_step(), self.ckpt.directory)
        with open(self.metrics_path if self.lead else os.devnull, "a") as mf, \
                open(self.skipped_path if self.lead else os.devnull, "a") as sf:
            for step in range(self.start, end):
                n = step + 1
                preempt.step = step
                replan = self.replan_every and n % self.replan_every == 0
                m = watched_step(self.runner, n, traced(n) or replan, report.say,
                                 warm=step > self.start, limits=self.spikes.limits())
                trace = m.pop("trace", None)
                if traced(n) and self.lead:
                    write_trace(self.workdir, n, cfg, self.plan, trace)
                rec = self.record(n, m)
                if evaluate_at(n):
                    with CompileWatch() as w:
                        rec["eval_loss"] = evaluate()
                    report.say(f"step {n}: eval_loss {rec['eval_loss']:.4f}" + (
                        f" (compiled the evaluation's {w.count} programs in {w.seconds:.1f} s)"
                        if w.count else ""))
                # no switch in a bad streak: it could not checkpoint
                switch = self.replan(n, trace) if replan and not self.in_a_row else None
                if switch is not None:
                    rec["replanned"] = {"gain": switch[1], "plan": switch[2]}
                records.append(rec)
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                for name, reason, (file, kind, at) in m["skipped_list"]:
                    sf.write(json.dumps({"step": n, "id": name, "file": file, kind: at,
                                         "reason": reason}) + "\n")
                sf.flush()
                report.step(rec, m.get("compile_s", 0.0) > 0)
                skips.step(n, m["skipped"], m["skipped_list"])
                self.guard(n, rec, max_bad_steps)
                self.bad_data_guard(n, sf)
                # a step in a bad streak changed no parameters: no checkpoint until one is good
                saved, self.owed = checkpoint_now(n % checkpoint_every == 0 or n == end
                                                  or bool(switch), self.in_a_row, self.owed)
                if saved:
                    self.save(n)
                    if self.lead:
                        self.plot()
                if switch is not None:
                    self.switch(n, switch[0], switch[1], report, rebuild=n < end)
                if n < end and preempt.requested():
                    self.preempted(n, preempt.signame or "a peer's signal", saved)
        if records:
            report.say("trained " + report.summary(len(records)))
            said = skips.summary(len(records) * report.global_batch)
            if said:
                report.say(said)
            if self.lead and self.plotted != records[-1]["step"]:
                self.plot()
            if self.lead and self.plotted is not None:
                report.say(f"loss curve: {os.path.join(self.workdir, 'loss.png')}")
        return records

    def plot(self) -> None:
        """DIR/loss.png from metrics.jsonl (matplotlib; at each checkpoint and the end)."""
        self.plotted = plot_workdir(self.workdir)

    def preempted(self, n: int, signame: str, saved: bool) -> None:
        """Stop after step `n` on a signal: its checkpoint written (unless a bad streak
        holds it back: then the last good one stands) and committed, then `Preempted`."""
        if not saved and not self.in_a_row:
            self.save(n)
        self.ckpt.wait()
        resume = self.ckpt.latest_step()
        raise Preempted(signame, n, resume, self.ckpt.directory)

    def replan(self, n: int, trace) -> tuple | None:
        """(new plan, predicted gain, its file under the workdir) when process 0's
        replanner switches plans at step `n`, the same on every process; else None."""
        text = None
        if self.lead:
            self.plan_traces += trace
            try:
                decision = self.replanner.decide(self.plan, self.plan_traces)
                if decision is not None:
                    decision = (self.prepare(decision[0])[0], decision[1])
            except ValueError as e:  # UserError, PlanError: the run goes on, on its plan
                self.console.print(f"step {n}: re-planning keeps the plan: {e}", markup=False)
                decision = None
            text = decision_json(decision)
        decision = decision_from_json(from_process_0(text))
        if decision is None:
            return None
        new, gain = decision
        return new, gain, os.path.relpath(plan_path(self.workdir, n), self.workdir)

    def switch(self, n: int, plan, gain: float, report, rebuild: bool) -> None:
        """Continue from step `n`'s checkpoint (committed first, then plans/step_<n>.json
        written) under `plan`; without `rebuild` (the invocation's last step) only the
        record changes: a rerun resumes on `plan`."""
        self.ckpt.wait()
        if self.lead:
            where = write_plan(self.workdir, n, plan)
            self.record_plan(plan)
            self.console.print(switch_line(n, self.plan, plan, gain, where), markup=False)
        self.plan, self.plan_traces = plan, []
        if rebuild:
            self.rebuild(n, lambda: self.build(plan), report)

    def rebuild(self, n: int, make_runner, report=None) -> None:
        """Replace the runner by `make_runner()` (another plan), restored from step `n`'s
        checkpoint (n = 0: a fresh start)."""
        self.runner.close()
        self.runner = None  # the old plan's arrays go before the new plan's are made
        self.runner = make_runner()
        self.runner.progress = report
        if n:
            state, data_state = self.ckpt.restore(n, self.runner.restore_target())
            self.runner.load(state, data_state, n)

    def record(self, n: int, m: dict) -> dict:
        """The metrics row of step `n`: tokens seen (every non-pad LLM position) and tokens
        trained (loss targets: masked prompt tokens count in neither the loss nor the
        trained figure)."""
        self.skipped += m["skipped"]
        spike = bool(m.get("spike", 0.0))
        bad = bool(m["nonfinite"]) or spike
        self.nonfinite += bool(m["nonfinite"])
        self.spike_steps += spike
        self.in_a_row = (self.in_a_row + 1) if bad else 0
        if spike and self.lead:
            self.console.print(f"step {n}: {self.spikes.describe(m)}: not applied (loss-spike "
                               f"guard, {self.in_a_row} in a row)", markup=False)
        if not bad:
            self.spikes.add(m["loss"], m["grad_norm"])
        return {"step": n, "loss": m["loss"], "lm_loss": m["lm_loss"],
                "diffusion_loss": m["diffusion_loss"], "grad_norm": m["grad_norm"],
                "learning_rate": float(self.schedule(n - 1)),
                "tokens_per_s": m["tokens"] / m["step_time_s"],
                "trained_tokens_per_s": m["tokens_trained"] / m["step_time_s"],
                "tokens_seen": m["tokens"], "tokens_trained": m["tokens_trained"],
                "step_time_s": m["step_time_s"], "data_wait_s": m["data_wait_s"],
                "skipped_samples": self.skipped, "nonfinite_steps": self.nonfinite,
                "spike_steps": self.spike_steps}

    def guard(self, n: int, rec: dict, max_bad_steps: int) -> None:
        if self.in_a_row >= max_bad_steps:
            raise TrainingStopped(
                f"{self.in_a_row} steps in a row ({n + 1 - self.in_a_row}..{n}) had a "
                f"non-finite or spiking loss or gradient norm (last: loss {rec['loss']}, grad_norm "
                f"{rec['grad_norm']}); none was applied. Last good checkpoint: "
                f"{_last_good(self.ckpt)} (lower the learning rate or check the data, then "
                f"rerun to resume; train.max_bad_steps={max_bad_steps})")

    def bad_data_guard(self, n: int, skip_log) -> None:
        """Stop once the share of bad samples passes `Loader.max_bad_fraction`."""
        data = self.runner.data
        limit = getattr(getattr(data, "loader", data), "max_bad_fraction", 1.0)
        skip_log.flush()
        why = too_much_bad_data(n, self.runner.global_batch, self.skipped, limit,
                                self.skipped_path)
        if why:
            raise TrainingStopped(f"{why}; last good checkpoint: {_last_good(self.ckpt)}")

    def save(self, n: int) -> None:
        try:
            self.ckpt.save(n, self.runner.checkpoint_tree(),
                           {**self.runner.data_state(), "skipped_samples": self.skipped,
                            "nonfinite_steps": self.nonfinite,
                            "spike_steps": self.spike_steps,
                            "spike_history": self.spikes.state()})
        except NonFiniteState as e:
            raise TrainingStopped(f"step {n}: {e}; last good checkpoint: "
                                  f"{_last_good(self.ckpt)} (lower the learning rate, "
                                  f"then rerun to resume)") from None

    def close(self) -> None:
        self.preempt.__exit__(None, None, None)
        self.ckpt.close()
        if self.runner is not None and hasattr(self.runner, "close"):
            self.runner.close()
