"""One invocation's training steps (`TrainLoop`): resume from the newest good checkpoint,
then per step the runner's step, the metrics row, the skipped samples, the non-finite and
loss-spike guards, the checkpoint, re-planning and preemption. The runner (train/runner.py)
owns the training state; this loop owns the run's counters (skipped samples, bad steps, the
spike history) and checkpoints both.
"""
from __future__ import annotations

import json
import os

import jax

from mmjax.errors import UserError
from mmjax.planner.plan import Plan
from mmjax.train.bad_data import too_much_bad_data
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.checkpoint_integrity import NonFiniteState
from mmjax.train.checkpoint_space import SaveFailed
from mmjax.train.compile_watch import CompileWatch, watched_step
from mmjax.train.loss_plot import plot_workdir
from mmjax.train.pipelined import write_trace
from mmjax.train.plan_history import forget_plans_after, plan_path, write_plan
from mmjax.train.preemption import Preempted, Preemption
from mmjax.train.progress import console as progress_console
from mmjax.train.replanning import decision_from_json, decision_json, from_process_0, switch_line
from mmjax.train.run_files import truncate_metrics
from mmjax.train.optimizer import learning_rate_table
from mmjax.train.run_report import SkipReport
from mmjax.train.runner import Runner, StepMetrics
from mmjax.train.spike_guard import SpikeGuard
from mmjax.train.startup_barrier import DEFAULT_TIMEOUT_S, StartupTimeout


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


class TrainLoop:
    """One invocation's steps: resume from the newest good checkpoint, then per step the
    metrics row, the skipped samples, the non-finite guard and the checkpoint. Multi-process
    (mmjax.launch): every process runs it; process 0 writes the metrics; every process
    writes the checkpoint shards it holds (orbax multi-host, one commit)."""

    def __init__(self, workdir: str, runner: Runner, schedule, keep: int,
                 keep_every: int | None, spikes: SpikeGuard | None = None,
                 startup_timeout: float = DEFAULT_TIMEOUT_S):
        self.workdir, self.runner, self.schedule = workdir, runner, schedule
        self.spikes = spikes or SpikeGuard(0.0, 20)
        self.owed = False  # a checkpoint fell due inside a bad streak
        self.lead = jax.process_index() == 0
        self.console = console = progress_console()
        try:
            self.ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep, keep_every,
                                     log=lambda m: console.print(m, markup=False) if self.lead
                                     else None, startup_timeout=startup_timeout)
        except StartupTimeout as e:
            raise TrainingStopped(str(e)) from None
        if jax.process_count() > 1 and self.lead:
            console.print(f"{jax.process_count()} processes: metrics from process 0, "
                          "checkpoints from all")
        self.start, self.skipped, self.nonfinite, self.in_a_row = 0, 0, 0, 0
        self.plotted: int | None = None  # the last step in loss.png
        self.spike_steps = 0
        self.replan_every = 0
        self.plan_traces: list[dict] = []
        self.plan: Plan | None = None
        # from here a SIGTERM / SIGINT waits for a step boundary (restore and compile
        # included: the run then stops before its first step, nothing lost)
        self.preempt = Preemption(self.lead).__enter__()
        try:
            found = self.ckpt.restore_latest(runner.restore_target())
        except BaseException:
            self.preempt.__exit__(None, None, None)
            raise
        if found is not None:
            latest, state, data_state = found
            notice = runner.load(state, data_state, latest)
            self.start, self.skipped = latest, int(data_state.get("skipped_samples", 0))
            self.nonfinite = int(data_state.get("nonfinite_steps", 0))
            self.spike_steps = int(data_state.get("spike_steps", 0))
            self.spikes.restore(data_state.get("spike_history", []))
            console.print(f"resumed from {workdir}/checkpoints step {latest}")
            if notice and self.lead:
                console.print(notice, markup=False)
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
        """The steps up to `end`; a checkpoint that cannot be written stops the run at once
        (TrainingStopped naming the directory, the space needed and the last good one)."""
        try:
            return self._run(end, report, checkpoint_every, max_bad_steps, traced,
                             evaluate_at, evaluate, cfg, plan)
        except SaveFailed as e:
            raise TrainingStopped(f"{e}; last good checkpoint: {_last_good(self.ckpt)}") \
                from None

    def _run(self, end: int, report, checkpoint_every: int, max_bad_steps: int, traced,
             evaluate_at, evaluate, cfg, plan) -> list[dict]:
        records = []
        self.plan = self.plan or plan
        # every step's learning rate, read on the host: evaluated once here, so the step
        # loop runs no eager op that would trace or compile after warm-up
        self.learning_rates = learning_rate_table(self.schedule, end)
        skips = SkipReport(report.say, self.skipped_path)
        preempt = self.preempt
        preempt.step = self.start
        if self.start < end and preempt.requested():  # a signal during start-up
            self.ckpt.wait()
            raise Preempted(preempt.signame or "a peer's signal", self.start,
                            self.ckpt.latest_step(), self.ckpt.directory)
        preempt.starting = False  # from here a signal stops after the step in flight
        with open(self.metrics_path if self.lead else os.devnull, "a") as mf, \
                open(self.skipped_path if self.lead else os.devnull, "a") as sf:
            for step in range(self.start, end):
                n = step + 1
                preempt.step = step
                replan = bool(self.replan_every) and n % self.replan_every == 0
                m = watched_step(self.runner, n, traced(n) or replan, report.say,
                                 warm=step > self.start, limits=self.spikes.limits())
                trace = m.trace
                if traced(n) and self.lead:
                    assert self.plan is not None  # `traced_steps`: only a plan's steps
                    write_trace(self.workdir, n, cfg, self.plan, trace,
                                max(m.compiled_programs, int(m.compile_s > 0)))
                rec = self.record(n, m)
                if evaluate_at(n):
                    self.record_eval(n, rec, evaluate, report)
                # no switch in a bad streak: it could not checkpoint
                switch = self.replan(n, trace) if replan and not self.in_a_row else None
                if switch is not None:
                    rec["replanned"] = {"gain": switch[1], "plan": switch[2]}
                records.append(rec)
                mf.write(json.dumps(rec) + "\n")
                mf.flush()
                for name, reason, (file, kind, at) in m.skipped_list:
                    sf.write(json.dumps({"step": n, "id": name, "file": file, kind: at,
                                         "reason": reason}) + "\n")
                sf.flush()
                report.step(rec, m.compile_s > 0)
                skips.step(n, m.skipped, m.skipped_list)
                self.guard(n, rec, max_bad_steps)
                self.bad_data_guard(n, sf)
                # a step in a bad streak changed no parameters: no checkpoint until one is good
                saved, self.owed = checkpoint_now(n % checkpoint_every == 0 or n == end
                                                  or bool(switch), self.in_a_row, self.owed)
                if saved:
                    self.save(n)
                    if self.lead:
                        self.plot()
                self.ckpt.check()  # a save that failed in the background stops the run now
                if switch is not None:
                    self.switch(n, switch[0], switch[1], report, rebuild=n < end)
                if n < end and preempt.requested():
                    self.preempted(n, preempt.signame or "a peer's signal", saved)
        self.ckpt.wait()  # the last save committed (or its failure reported) before "trained"
        if records:
            self.closing_lines(records, report, skips)
        return records

    @staticmethod
    def record_eval(n: int, rec: dict, evaluate, report) -> None:
        """Step `n`'s validation loss into its metrics row `rec`, said on the console."""
        with CompileWatch() as w:
            rec["eval_loss"] = evaluate()
        report.say(f"step {n}: eval_loss {rec['eval_loss']:.4f}" + (
            f" (compiled the evaluation's {w.count} programs in {w.seconds:.1f} s)"
            if w.count else ""))

    def closing_lines(self, records: list[dict], report, skips: SkipReport) -> None:
        """The invocation's closing lines (steps trained, samples skipped, the loss curve)."""
        report.say("trained " + report.summary(len(records)))
        said = skips.summary(len(records) * report.global_batch)
        if said:
            report.say(said)
        if self.lead and self.plotted != records[-1]["step"]:
            self.plot()
        if self.lead and self.plotted is not None:
            report.say(f"loss curve: {os.path.join(self.workdir, 'loss.png')}")

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
            except UserError as e:  # PlanError too: the run goes on, on its plan
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
            assert self.plan is not None  # re-planning runs on plans only
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
        del self.runner  # the old plan's arrays go before the new plan's are made
        self.runner = make_runner()
        self.runner.progress = report
        if n:
            state, data_state = self.ckpt.restore(n, self.runner.restore_target())
            self.runner.load(state, data_state, n)

    def record(self, n: int, m: StepMetrics) -> dict:
        """The metrics row of step `n`: tokens seen (every non-pad LLM position) and tokens
        trained (loss targets: masked prompt tokens count in neither the loss nor the
        trained figure). The run's skip total is this loop's (checkpointed with it)."""
        self.skipped += m.skipped
        spike = m.spike
        bad = not m.applied
        self.nonfinite += m.nonfinite
        self.spike_steps += spike
        self.in_a_row = (self.in_a_row + 1) if bad else 0
        if spike and self.lead:
            self.console.print(f"step {n}: {self.spikes.describe(m.loss, m.grad_norm)}: not applied (loss-spike "
                               f"guard, {self.in_a_row} in a row)", markup=False)
        if not bad:
            self.spikes.add(m.loss, m.grad_norm)
        return {"step": n, "loss": m.loss, "lm_loss": m.lm_loss,
                "diffusion_loss": m.diffusion_loss, "grad_norm": m.grad_norm,
                "learning_rate": float(self.learning_rates[n - 1]),
                "tokens_per_s": m.tokens / m.step_time_s,
                "trained_tokens_per_s": m.tokens_trained / m.step_time_s,
                "tokens_seen": m.tokens, "tokens_trained": m.tokens_trained,
                # the packing's fill: real tokens / the LLM slots the step computed on
                "llm_slots": m.llm_slots,
                "llm_fill": m.tokens / m.llm_slots if m.llm_slots else 0.0,
                "step_time_s": m.step_time_s, "data_wait_s": m.data_wait_s,
                "skipped_samples": self.skipped, "nonfinite_steps": self.nonfinite,
                "spike_steps": self.spike_steps, **m.extra}

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
        skip_log.flush()
        why = too_much_bad_data(n, self.runner.global_batch, self.skipped,
                                self.runner.max_bad_fraction, self.skipped_path)
        if why:
            raise TrainingStopped(f"{why}; last good checkpoint: {_last_good(self.ckpt)}")

    def save(self, n: int) -> None:
        arrays, data_state = self.runner.checkpoint()
        try:
            self.ckpt.save(n, arrays, {**data_state, "skipped_samples": self.skipped,
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
        runner = getattr(self, "runner", None)  # none while a rebuild that failed
        if runner is not None:
            runner.close()
