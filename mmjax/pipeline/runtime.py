"""Host-driven MPMD pipeline runtime over the unit DAG (docs/design.md "Execute the schedule").

Every stage of every unit lives on its own sub-mesh with its own jitted forward/backward
(pipeline/stage.py; a frozen `Stage` built by pipeline/stage_setup.py). `run` dispatches
one whole step: every action of the schedule chosen by name (schedule/named.py) in one
dependency-respecting global order, moving activations and gradients between stages
through the brokers (pipeline/transfers.py); JAX's async dispatch lets stages on disjoint
devices run concurrently, and the loop makes no host sync in single-process runs.
Multi-process behaviour: docs/design.md "The runtime in several processes".

The runtime is built once from the plan and holds no training state: a step is a function
of the frozen stages, the compute copy of every stage's parameters (handed in by the
caller, train/pipelined.py) and the microbatch feeds, to the losses and each stage's
partial gradients. Its mutable state is its own and small: the initial parameters until
taken, the backward dispatch counts, and the brokers' ledgers (`transfers`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, cast

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.data.feed import MicrobatchFeed
from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.models.units import LLM_UNIT, is_generator, is_vae
from mmjax.parallel.mesh import stage_meshes
from mmjax.parallel.sharded_init import abstract_split
from mmjax.pipeline.lora_dropout import dropout_units
from mmjax.pipeline.multiprocess import holds_local_device, sync_collectives
from mmjax.pipeline.stage_modules import stage_module
from mmjax.pipeline.stage_actions import StageActions, StepState
from mmjax.pipeline.stage_setup import Stage, build_stage, stage_filter
from mmjax.pipeline.step_result import StepResult
from mmjax.pipeline.trace import make_tracer, trace_mode
from mmjax.pipeline.transfers import Transfers
from mmjax.planner.plan import Plan
from mmjax.schedule.dependencies import dispatch_order
from mmjax.schedule.named import named_schedule
from mmjax.schedule.stage_graph import Backward, StageGraph, StageId


class PipelineRuntime:
    def __init__(self, cfg: MLLMConfig, plan: Plan, devices=None, seed: int = 0,
                 compute_dtype=jnp.float32, pretrained: dict | None = None,
                 llm_mask_family: str = "bam", schedule: str = "1f1b",
                 exchange: str = "staged"):
        """`pretrained` {unit: HF checkpoint directory}: each stage of those units reads
        its own layers (its devices' blocks) straight onto its sub-mesh after placement;
        `cfg` must already describe them (`hf.pretrained_config`). `llm_mask_family`: the
        feeds' `AssemblyLayout.llm_mask_family`. `schedule`: a name of schedule/named.py
        `SCHEDULES` (`train.schedule`). `exchange`: the brokers' form, "staged" or "ragged"
        (GPU; `ragged_exchange.exchange_kind`)."""
        plan.validate(cfg, len(devices if devices is not None else jax.devices()))
        pretrained = pretrained or {}
        self.cfg, self.plan, self.dtype = cfg, plan, compute_dtype
        self.meshes = stage_meshes(plan, devices)
        self.graph, made = _stage_graph(cfg, plan, jax.random.key(seed))
        self.num_virtual = {u.name: u.pp * u.num_chunks for u in plan.units}
        self._check_tied_placement()
        # one row per physical stage, i.e. per mesh, merged into one dependency-respecting
        # dispatch order; JAX runs each mesh's work in dispatch order, so each mesh
        # executes exactly its row. Entries are (virtual StageId, Action), Action.chunk
        # the chunk on its mesh.
        self.schedule_name = schedule
        self.schedule = named_schedule(schedule, self.graph, plan.num_microbatches)
        self.order = [(self.graph.virtual(cast(StageId, s), a.chunk), a)  # the graph's stages
                      for s, a in dispatch_order(self.schedule, self.graph)]
        # index in `order` of each stage's last backward (its gradients are final there)
        self.last_backward = {sid: i for i, (sid, a) in enumerate(self.order) if a.kind == "B"}
        self.stages: dict[StageId, Stage] = {}
        self._initial: dict | None = {}  # the seed's / pretrained parameters, until taken
        for sid in self.graph.stages:
            mesh = self.meshes[sid.unit][sid.index % plan.unit(sid.unit).pp]
            self.stages[sid], self._initial[sid] = build_stage(
                cfg, plan.unit(sid.unit), sid, made[sid], mesh,
                Backward(self.graph.has_backward[sid]), pretrained, compute_dtype,
                llm_mask_family)
        self.backward_calls = {sid: 0 for sid in self.stages}  # dispatched (a diagnostic)
        self.sync = sync_collectives()
        self.transfers = Transfers(self.stages, self.graph, self.num_virtual["llm"],
                                   cfg.generator is not None, self.sync, dropout_units(cfg),
                                   exchange)
        self.actions = StageActions(self.stages, self.graph, self.transfers, self.settle,
                                    StageId(LLM_UNIT, self.num_virtual["llm"] - 1),
                                    cfg.generator is not None)

    def _check_tied_placement(self) -> None:
        nv = self.num_virtual["llm"]
        if self.cfg.llm.tie_embeddings and nv > 1 and not all(
                holds_local_device(m) for m in (self.meshes["llm"][0], self.meshes["llm"][-1])):
            raise UserError("tie_embeddings=True with the llm's first and last stage in "
                            "different processes: the embedding group sums their gradients "
                            "within one process (order the plan's devices so both stages sit "
                            "on one host, or use llm pp=1)")

    @property
    def brokers(self) -> dict:
        """{(source, destination): Broker} used so far (their ledgers count the traffic)."""
        return self.transfers.brokers

    # ---- parameters -------------------------------------------------------------------
    def take_initial_params(self) -> dict:
        """{StageId: fp32 trainable parameters} as the seed (or the pretrained checkpoint)
        makes them, placed on each stage's mesh (abstract for a mesh in other processes);
        handed over once, to the training state's owner, which keeps the only reference."""
        if self._initial is None:
            raise RuntimeError("internal: the runtime's initial parameters were taken already")
        params, self._initial = self._initial, None
        return params

    def compute_params(self, trainable: dict) -> dict:
        """{StageId: fp32 trainable} (any dp sharding) -> the compute copies the stages read
        (compute dtype, replicated over dp, TP-sharded); remote stages stay abstract."""
        return {sid: (self.settle(self.stages[sid].gather(tr)) if self.stages[sid].local
                      else tr) for sid, tr in trainable.items()}

    def initial_compute_params(self) -> dict:
        """The compute copy of the initial parameters, which stay the runtime's: `run` on
        its own, with no training state (scripts/bench_runtime.py, the parity tests)."""
        if self._initial is None:
            raise RuntimeError("internal: the runtime's initial parameters were handed to a "
                               "training state: pass its compute copies")
        return self.compute_params(self._initial)

    # ---- what a training state's owner asks of the stages -------------------------------
    def trained_stages(self) -> list[StageId]:
        """The stages with parameter gradients (in every process), in graph order."""
        return [sid for sid, st in self.stages.items() if st.mode.param_grads]

    def is_local(self, sid: StageId) -> bool:
        """Whether stage `sid`'s mesh holds a device of this process."""
        return self.stages[sid].local

    def zero_placement(self, sid: StageId) -> tuple:
        """(mesh of the stage's ZeRO state (its FSDP-group view), ZeRO stage 1-3)."""
        st = self.stages[sid]
        return st.zero_mesh, st.zero_stage

    def set_frozen(self, sid: StageId, frozen) -> None:
        """Stage `sid` with other frozen weights (a peft adapter's base, read after the
        stages were built: train/lora_stages.py); the Stage itself stays immutable."""
        self.stages[sid] = dataclasses.replace(self.stages[sid], frozen=frozen)

    def abstract_params(self, sid: StageId):
        """Stage `sid`'s trainable parameters' shapes, dtypes and shardings."""
        return self.stages[sid].abstract

    # ---- one step -------------------------------------------------------------------
    def run(self, feeds: list[MicrobatchFeed], params: dict,
            trace: bool | str = False, on_grads=None, count: int | None = None
            ) -> StepResult:
        """Dispatch one whole step: forward and backward of every microbatch on `params`
        ({StageId: compute copy}), every action of the
        schedule before it returns. Returns device-side losses and the step's gradients
        (`StepResult.partials`, `grads`). `on_grads(sid, partials)`, if given, is called
        for every local stage with trainable parameters as soon as the stage's last
        backward is dispatched (a tied embedding's two stages last, once their copies are
        summed), and takes those partials over (they are not in the result): the caller's
        gradient sync of one stage then overlaps the backward work the others still have.
        `trace` (pipeline/trace.py): False; True or "serial" (each action waited on:
        isolated costs, no overlap); "overlap" (waiter threads stamp completions;
        dispatch stays free of host syncs). `count`: the applied-step count of a training
        step (LoRA dropout's masks, pipeline/lora_dropout.py); None: no dropout."""
        if len(feeds) != self.plan.num_microbatches:
            raise ValueError(f"got {len(feeds)} microbatch feeds; the plan has "
                             f"{self.plan.num_microbatches}")
        step = StepState.of(feeds, params, count)
        tracer = make_tracer(trace_mode(trace))
        result = step.result
        result.reduced = {sid for sid, st in self.stages.items() if st.zero_stage >= 2}
        # `zeros` is None only without parameter gradients, which this filter leaves out
        result.partials = {sid: self.settle(cast(Callable, st.zeros)())
                           for sid, st in self.stages.items() if st.mode.param_grads and st.local}
        tied = self.tied_embedding_stages() or ()
        for i, (sid, act) in enumerate(self.order):
            self._dispatch(sid, act, step, tracer, self.last_backward.get(sid) == i)
            if (on_grads is not None and self.last_backward.get(sid) == i
                    and sid not in tied and sid in result.partials):
                on_grads(sid, result.partials.pop(sid))
        self._sum_tied_embedding_grads(result.partials)
        if on_grads is not None:
            for sid in list(result.partials):
                on_grads(sid, result.partials.pop(sid))
        result.reduced &= set(result.partials)
        if tracer:
            result.trace = tracer.finish()
        return result

    def _dispatch(self, sid: StageId, act, step: StepState, tracer, last: bool) -> None:
        """One action of the schedule: its stage's host inputs placed (once per
        microbatch), its forward or backward dispatched (`last`: the stage's last
        backward), traced if asked."""
        mb = act.microbatch
        t0 = tracer.start() if tracer else 0.0
        if (sid, mb) not in step.sides:
            step.sides[(sid, mb)] = self.transfers.side(
                sid, step.feeds[mb], step.totals,
                None if step.count is None else (step.count, mb))
        if act.kind == "F":
            self.actions.forward(sid, mb, step)
        else:
            self.actions.backward(sid, mb, step, last)
            self.backward_calls[sid] += 1
        if tracer:
            self.actions.trace(tracer, sid, act, t0, step)
        if act.kind == "B" or not self.graph.runs_backward(sid):
            step.sides.pop((sid, mb), None)

    def evaluate(self, feeds: list[MicrobatchFeed], params: dict) -> StepResult:
        """The LM loss terms of `feeds` by forward passes alone (validation): every LLM and
        encoder stage's `apply` in the schedule's forward order, nothing kept for a backward
        and no gradients; the generator (diffusion loss) is not run. `losses()["lm_loss"]`
        is the feeds' mean loss per trained token, as in `run`. `params`: as in `run`."""
        step = StepState.of(feeds, params)
        for sid, act in self.order:
            if act.kind == "F" and not (is_generator(sid.unit) or is_vae(sid.unit)):
                self.actions.apply(sid, act.microbatch, step)
        return step.result

    def tied_embedding_stages(self) -> tuple[StageId, StageId] | None:
        """(first, last) LLM stage when both hold a copy of a tied embedding, else None."""
        n = self.num_virtual["llm"]
        if not self.cfg.llm.tie_embeddings or n == 1:
            return None
        return StageId(LLM_UNIT, 0), StageId(LLM_UNIT, n - 1)

    def _sum_tied_embedding_grads(self, grads: dict) -> None:
        """Megatron's embedding group: a tied LLM over several stages keeps the embedding on
        its first stage (input) and last stage (LM head); each copy gets the sum of both
        gradients every step, so copies that start equal stay equal, and equal the single
        model's embedding (its gradient is that sum). `grads`: StageId -> gradient state."""
        pair = self.tied_embedding_stages()
        if pair is None or pair[0] not in grads or pair[1] not in grads:  # a frozen LLM
            return
        first, last = grads[pair[0]], grads[pair[1]]
        a, b = nnx.to_pure_dict(first), nnx.to_pure_dict(last)
        total = a["embed"] + jax.device_put(b["embed"], a["embed"].sharding)
        a["embed"], b["embed"] = total, jax.device_put(total, b["embed"].sharding)
        nnx.replace_by_pure_dict(first, a)
        nnx.replace_by_pure_dict(last, b)

    def settle(self, out):
        """On multi-process CPU runs, finish each dispatch before the next
        (pipeline/multiprocess.py `sync_collectives`); otherwise a no-op, keeping the loop
        free of host syncs."""
        return jax.block_until_ready(out) if self.sync else out


def _stage_graph(cfg: MLLMConfig, plan: Plan, root) -> tuple[StageGraph, dict]:
    """(the StageGraph a step walks: virtual stages StageId(unit, chunk * pp + s), their
    backward modes from which stages hold trainable parameters; {virtual StageId: (module
    maker, args, key, filters)})."""
    per_stage_trainable, made = {}, {}
    for u in plan.units:
        flags = []
        for v in range(u.pp * u.num_chunks):  # virtual stage v = chunk * pp + stage
            start, end = u.stage_layers(v % u.pp, v // u.pp)
            m = (stage_module, (cfg, u.name, start, end), root,
                 (stage_filter(cfg, u.name), ...))
            _, tr, _ = abstract_split(*m, None)
            flags.append(bool(jax.tree.leaves(tr)))
            made[StageId(u.name, v)] = m
        per_stage_trainable[u.name] = tuple(flags)
    graph = StageGraph.from_dag(cfg.units, {u.name: u.pp for u in plan.units},
                                per_stage_trainable, {u.name: u.num_chunks for u in plan.units})
    return graph, made
