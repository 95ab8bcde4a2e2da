"""A Plan's training steps on the pipeline runtime: the runner that owns the run's
`TrainState` (train/state.py) and steps it.

Per step: the loader's global batch -> `PipelineRuntime.run` (forward and backward of every
microbatch on the state's compute copies, the whole schedule in one call; each stage's
partial gradients handed to `on_grads` as soon as its last backward is dispatched) -> per
trained stage ONE reduce-scatter into its ZeRO-1 shards (`Zero1Optimizer.sync`,
overlapping the backwards other stages still run) -> the global norm over all stages (train/global_norm.py) -> per stage ONE program with the AdamW
update and the all-gather of the new compute copy (`Zero1Optimizer.step`) -> the new state.
The update equals the single-program optimizer over the whole model. Details:
docs/design.md "One step" and "One gradient sync per step".

Multi-process: a process keeps state only for the stages with devices in it; the global
norm is reduced across processes, and on CPU each stage update is waited on (gloo deadlock
note in pipeline/multiprocess.py `sync_collectives`).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.data.feed import gen_elements_per_image
from mmjax.data.stream_position import (STATE_KEY, resume_notice, stored_position,
                                        stream_state)
from mmjax.models.config import MLLMConfig
from mmjax.models.hf.pretrained import whole_base
from mmjax.parallel.ragged_exchange import exchange_kind
from mmjax.parallel.zero import Zero1Optimizer
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.pipeline.stage import rank_axes
from mmjax.planner.plan import Plan
from mmjax.train.data_config import train_source
from mmjax.train.global_norm import fold_loss, multiprocess_norm, norm_from_squares
from mmjax.train.held_out import held_out_loss
from mmjax.train.host_failures import agree_on_failures
from mmjax.train.logical_state import (pipeline_from_logical, pipeline_global_logical,
                                       remote_stage, restore_target)
from mmjax.train.lora_stages import adapter_into_stages
from mmjax.train.optimizer import (OptimizerSettings, applied_updates, optimizer_from_settings,
                                   rate_as_input)
from mmjax.train.runner import StepMetrics
from mmjax.train.state import StageState, TrainState

_NO_LIMITS = (np.inf, np.inf)


class PipelinedRunner:
    """A Plan on the pipeline runtime, fed by `data` (a `Loader`; None: feeds handed to
    `train_on`), its LLM mask family `layout`'s (else "bam"). `state` is the run's
    TrainState; the runtime is built once from the plan and reads the compute copies it is
    handed."""

    def __init__(self, cfg: MLLMConfig, plan: Plan, schedule, compute_dtype=jnp.float32,
                 seed: int = 0, settings: OptimizerSettings | None = None, devices=None,
                 pretrained: dict | None = None, data=None, layout=None, memory_line: str | None = None,
                 pipeline_schedule: str = "1f1b"):
        self.cfg, self.plan, self.global_batch = cfg, plan, plan.global_batch
        self.data, self.layout, self.memory_line = data, layout, memory_line
        self.settings = settings or OptimizerSettings()
        rt = self.runtime = PipelineRuntime(
            cfg, plan, devices, seed, compute_dtype, pretrained,
            layout.llm_mask_family if layout is not None else "bam",
            pipeline_schedule, exchange_kind(data.exchange if data is not None else "auto"))
        self.tx = optimizer_from_settings(schedule, self.settings, clip=False)
        # the learning rate a stage update's input: its program does not depend on
        # train.steps; `updates`: the updates applied so far (optax's count)
        tx_at, self.rate_at = rate_as_input(schedule, self.settings, clip=False)
        self.updates = 0
        self.trained = rt.trained_stages()
        pair = rt.tied_embedding_stages()
        initial = rt.take_initial_params()
        if pretrained and "adapter" in pretrained:  # a peft adapter, after the base
            initial, frozen = adapter_into_stages(
                cfg, plan, initial, {sid: st.frozen for sid, st in rt.stages.items()},
                pretrained["adapter"], whole_base(pretrained) is not None)
            for sid, fr in frozen.items():
                rt.set_frozen(sid, fr)
        self.optimizers = {}
        for sid in self.trained:
            if not rt.is_local(sid):
                continue
            zero_mesh, zero_stage = rt.zero_placement(sid)  # the stage's ZeRO (FSDP groups)
            self.optimizers[sid] = Zero1Optimizer(
                self.tx, zero_mesh, initial[sid], clip_norm=self.settings.clip_norm or None,
                donate=True, compute_dtype=compute_dtype,
                # the single model has one embedding: the last stage's copy is counted once
                norm_skip=("embed",) if pair is not None and sid == pair[1] else (),
                rank_axes=rank_axes(zero_mesh),
                zero_stage=zero_stage,  # 2/3: each backward reduce-scatters
                tx_at=tx_at)
        stages = {}
        for sid, opt in self.optimizers.items():
            opt_state = opt.init(initial[sid])
            compute = rt.compute_params({sid: initial[sid]})[sid]  # from the placed params
            # the master weights keep only their ZeRO-1 shard on each device
            master = rt.settle(jax.jit(lambda t: t, out_shardings=opt.master_shardings)(
                initial.pop(sid)))
            stages[sid] = StageState(master, opt_state, compute)
        # the stages without an optimizer here (untrained, or in another process): fixed
        self.fixed = rt.compute_params(initial)
        self.state = TrainState(stages, 0, {} if data is None else data.get_state())
        self.num_trainable = sum(x.size for x in jax.tree.leaves(
            [rt.abstract_params(sid) for sid in rt.stages]))
        self.max_bad_fraction = 1.0 if data is None else data.max_bad_fraction
        # (StageId, program) per launch of a gradient-sync or update program, last step;
        # `sync_after[sid]`: backward actions dispatched (all stages) before sid's sync
        self.dispatch_log: list[tuple] = []
        self.sync_after: dict = {}
        self.seen_shapes: set = set()  # feed shapes run so far: a new one compiles
        self.steps_run, self.steps_traced = 0, 0
        self.progress: Any = None  # train/progress.py Progress, set by the trainer

    def compute_params(self) -> dict:
        """{StageId: compute copy} of every stage: what the runtime runs on."""
        return {**self.fixed, **{sid: st.compute for sid, st in self.state.stages.items()}}

    # ---- one step ---------------------------------------------------------------------
    def train_on(self, feeds, trace: bool = False, limits=_NO_LIMITS) -> StepMetrics:
        """One step over `feeds`; `limits` = (max loss, max gradient norm): a finite step
        above either is not applied (the trainer's loss-spike guard)."""
        rt = self.runtime
        self.dispatch_log, self.sync_after = [], {}
        shards, squares = {}, {}
        backwards0 = sum(rt.backward_calls.values())

        def sync(sid, partials):  # one reduce-scatter per stage, right after its last B
            if sid not in self.optimizers:  # an untrained or remote stage
                return
            shards[sid], squares[sid] = rt.settle(self.optimizers[sid].sync(partials))
            self.dispatch_log.append((sid, "reduce_scatter"))
            self.sync_after[sid] = sum(rt.backward_calls.values()) - backwards0

        res = rt.run(feeds, self.compute_params(), trace, on_grads=sync, count=self.updates)
        max_loss, max_norm = (float(x) for x in limits)
        if jax.process_count() == 1:
            norm = norm_from_squares([squares[sid] for sid in self.optimizers])
            guard = fold_loss(norm, res.lm_loss + res.diffusion_loss, max_loss, max_norm)
        else:  # the norm and the losses are host values here already
            norm = multiprocess_norm([squares.get(sid) for sid in self.trained])
            losses = res.losses()
            calm = losses["loss"] <= max_loss and norm <= max_norm
            guard = norm if np.isfinite(losses["loss"]) and calm else float("nan")
        # every stage's update is skipped on device when `guard` is not finite
        new = {}
        rate = None if self.rate_at is None else self.rate_at(self.updates)
        for sid, opt in self.optimizers.items():  # update + one all-gather per stage
            st = self.state.stages[sid]
            new[sid] = StageState(*rt.settle(opt.step(st.master, shards.pop(sid), st.opt,
                                                       guard, rate)))
            self.dispatch_log.append((sid, "update_all_gather"))
        self.state = self.state._replace(stages=new, step=self.state.step + 1)
        # the step's one host sync, after everything is dispatched
        out = res.losses() if jax.process_count() == 1 else losses
        grad_norm = float(norm)
        finite = bool(np.isfinite(out["loss"]) and np.isfinite(grad_norm))
        self.updates += finite and np.isfinite(float(guard))  # applied: the guard let it
        return StepMetrics(out["loss"], out["lm_loss"], out["diffusion_loss"], grad_norm,
                           nonfinite=not finite,
                           spike=finite and not np.isfinite(float(guard)),
                           trace=res.trace if trace else None)

    def step(self, trace: bool = False, limits=_NO_LIMITS) -> StepMetrics:
        """The loader's next global batch, trained on; `trace`: time every action alone
        (pipeline/trace.py "serial") and return the records in `trace`."""
        t_wait = time.perf_counter()
        gb = next(self.data)
        if jax.process_count() > 1:  # the hosts' decode failures, agreed before the step
            from jax.experimental import multihost_utils

            agree_on_failures(gb, multihost_utils.process_allgather,
                              gen_elements_per_image(self.layout))
        feeds = [mb.feed for mb in gb.microbatches]
        first = self.steps_run == 0
        if first and self.progress is not None:  # the stages compile inside the first step
            self.progress.compiling("the pipeline's stage programs (inside the first step)")
        t0 = time.perf_counter()
        m = self.train_on(feeds, trace=trace, limits=limits)
        self.state = self.state._replace(data=self.data.get_state())
        m.step_time_s = time.perf_counter() - t0
        self.steps_run += 1
        m.compile_s = m.step_time_s if first else 0.0
        if first and self.progress is not None:
            self.progress.compiled("the first pipelined step", m.step_time_s)
        m.data_wait_s = t0 - t_wait
        new = {f.shapes for f in feeds} - self.seen_shapes
        if new and not first:
            m.compile_reason = (f"{len(new)} new microbatch shapes outside the floor "
                                f"scanned at start-up (Loader.shape_scan_steps="
                                f"{self.data.shape_scan_steps})")
        elif trace and self.steps_traced == 0:
            m.compile_reason = "the first traced step: each action runs alone"
        self.seen_shapes |= {f.shapes for f in feeds}
        self.steps_traced += bool(trace)
        m.tokens = int(sum(np.count_nonzero(f.llm["doc"]) for f in feeds))
        m.llm_slots = int(sum(f.llm["doc"].size for f in feeds))
        m.tokens_trained = int(sum(f.num_target_tokens for f in feeds))
        m.skipped, m.skipped_list = gb.skipped_samples, list(gb.skipped)
        return m

    # ---- checkpoints ------------------------------------------------------------------
    def checkpoint(self) -> tuple[dict, dict]:
        """(plan-independent named arrays (train/logical_state.py), the same names on every
        process (stages of other processes as arrays without local shards); data state)."""
        arrays = pipeline_global_logical(
            self.plan, self.state.stages, self.trained,
            lambda sid: remote_stage(self.tx, self.runtime.zero_placement(sid)[0],
                                     self.runtime.abstract_params(sid)))
        return arrays, {STATE_KEY: self.state.data}

    def restore_target(self) -> dict:
        return restore_target(self.checkpoint()[0])

    def load(self, arrays: dict, data_state: dict, step: int) -> str | None:
        """A checkpoint of any plan (or of the single program: the loader then goes on from
        global batch `step` at that program's stream position). -> one line naming the
        data settings that changed since the position was stored (`resume_notice`)."""
        rt, stages = self.runtime, {}
        for sid, (master, opt) in pipeline_from_logical(self.plan, self.state.stages,
                                                        arrays).items():
            stages[sid] = StageState(master, opt, rt.compute_params({sid: master})[sid])
        position = stored_position(data_state)
        data = stream_state(data_state, step)
        if self.data is not None:
            self.data.set_state(data)
        self.state = TrainState(stages, step, data)
        self.updates = max((applied_updates(st.opt) for st in stages.values()), default=0)
        if self.layout is None:  # feeds handed to `train_on`: no data stream to go on with
            return None
        return resume_notice(position, step, self.global_batch, self.layout.seq_len)

    # ---- validation -------------------------------------------------------------------
    def evaluate(self, source, max_batches: int, layout) -> float:
        """`held_out_loss` by forward passes alone on this plan (`PipelineRuntime.evaluate`):
        the same samples as the whole-model runner's, so both report the same `eval_loss`."""
        from mmjax.data.loader import Loader

        def loss_and_tokens(gb) -> tuple[float, int]:
            feeds = [mb.feed for mb in gb.microbatches]
            lm = self.runtime.evaluate(feeds, self.compute_params()).losses()["lm_loss"]
            return lm, sum(f.num_target_tokens for f in feeds)

        return held_out_loss(
            source, max_batches, self.global_batch,
            lambda n: Loader.build(source, self.cfg, self.plan, layout, shuffle=False,
                                   num_steps=n),
            loss_and_tokens)

    def close(self):
        if self.data is not None:
            self.data.close()


def pipelined_runner(cfg, layout, plan, schedule, dtype, seed, source=None, pretrained=None,
                     steps: int | None = None, check_memory: bool = True,
                     announce=None, pipeline_schedule: str = "1f1b") -> PipelinedRunner:
    """The runner the trainer drives, fed by the grain loader (planning, balancing and
    assembly off the training path, in its prefetch thread or worker processes). `steps`:
    the run's length (the loader's `num_steps`); every feed is padded to the shapes of the
    first `Loader.shape_scan_steps` global batches (scanned from metadata at start-up,
    whatever the run's length), so no stage program compiles after the first step in a
    usual run and runs of any length share the cached programs. `check_memory`: refuse a plan whose units the planner's
    memory model does not fit in a device, before anything is built
    (train/memory_check.py); `announce`: called once that check passed (the trainer's
    line saying what compiles); `pipeline_schedule`: `train.schedule` (schedule/named.py)."""
    from mmjax.data.loader import Loader
    from mmjax.train.memory_check import check_plan

    source = source if source is not None else train_source(cfg)
    memory_line = check_plan(cfg, plan, source, jax.local_devices()[0],  # this process's
                             check_memory, schedule=pipeline_schedule)  # (memory_stats)
    if announce is not None:  # the parameters' init compiles next
        announce()
    # gin: `Loader.*` (balance, post_balance_policy, workers, ...); several processes:
    # each host decodes only its own DP ranks' samples
    local = (None if jax.process_count() == 1 else frozenset(
        i for i, d in enumerate(jax.devices()) if d.process_index == jax.process_index()))
    data = Loader.build(source, cfg, plan, layout, local_devices=local,
                        **({} if steps is None else {"num_steps": steps}))
    try:
        return PipelinedRunner(cfg, plan, schedule, dtype, seed, pretrained=pretrained,
                               data=data, layout=layout, memory_line=memory_line,
                               pipeline_schedule=pipeline_schedule)
    except BaseException:
        data.close()
        raise


def write_trace(workdir: str, step: int, cfg, plan: Plan, trace: list[dict],
                compiled: int = 0) -> str:
    """`<workdir>/traces/step_<step>.json`: what scripts/replan.py reads; `compiled`: the
    programs that compiled inside the step (replan.py leaves such steps out: their action
    times include compilation); `device`: the kind of device it ran on (replan.py prices
    the trace by that device's measured profile)."""
    path = os.path.join(workdir, "traces", f"step_{step}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"model": cfg.name, "plan": plan.to_json(), "trace": trace,
                   "compiled": compiled, "device": str(jax.devices()[0].device_kind)}, f)
    return path
