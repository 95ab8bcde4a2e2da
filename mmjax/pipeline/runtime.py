"""Host-driven MPMD pipeline runtime over the unit DAG (docs/design.md "Execute the schedule").

Every stage of every unit lives on its own sub-mesh with its own jitted forward/backward
(pipeline/stage.py; built by pipeline/stage_setup.py). `PipelineRuntime.start` walks the
schedule (schedule/schedule.py) in a dependency-respecting global order, moving activations
and gradients between stages through the brokers (pipeline/transfers.py); JAX's async dispatch lets stages on disjoint devices run concurrently, and the
loop makes no host sync in single-process runs. Multi-process behaviour: docs/design.md
"The runtime in several processes".

The runtime is built once from the plan and holds no training state: a step is a function
of the frozen stage specs (`Stage`), the compute copy of every stage's parameters (handed
in by the caller, train/pipelined.py) and the microbatch feeds, to the losses and each
stage's partial gradients. It calls nothing above it: `start` hands each stage's gradients
out as an iterator, as soon as the stage's last backward is dispatched.
"""
from __future__ import annotations

from dataclasses import dataclass, field

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
from mmjax.pipeline.multiprocess import abstract, holds_local_device, sync_collectives
from mmjax.pipeline.stage import make_stage_fns
from mmjax.pipeline.stage_modules import stage_module
from mmjax.pipeline.stage_setup import (Stage, abstract_params, load_pretrained_stage,
                                       load_vae_stage,
                                        stage_filter, stage_programs, stage_state)
from mmjax.pipeline.step_result import StepResult
from mmjax.pipeline.trace import completion_marker, make_tracer, trace_mode
from mmjax.pipeline.transfers import Transfers
from mmjax.planner.plan import Plan
from mmjax.schedule.dependencies import dispatch_order
from mmjax.schedule.schedule import multimodal_one_f_one_b
from mmjax.schedule.stage_graph import Backward, StageGraph, StageId


@dataclass
class _Step:
    """The in-flight state of one `run`: per (stage, microbatch) host inputs, forward
    outputs, residuals and cotangents; the result being filled."""

    feeds: list
    totals: tuple
    params: dict
    count: int | None = None  # the applied-step count (LoRA dropout's masks); None: eval
    sides: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    residuals: dict = field(default_factory=dict)
    cotangents: dict = field(default_factory=dict)
    result: StepResult = field(default_factory=StepResult)


class PipelineRuntime:
    def __init__(self, cfg: MLLMConfig, plan: Plan, devices=None, seed: int = 0,
                 compute_dtype=jnp.float32, pretrained: dict | None = None,
                 llm_mask_family: str = "bam"):
        """`pretrained` {unit: HF checkpoint directory}: each stage of those units reads
        its own layers (its devices' blocks) straight onto its sub-mesh after placement;
        `cfg` must already describe them (`hf.pretrained_config`). `llm_mask_family`: the
        feeds' `AssemblyLayout.llm_mask_family`."""
        plan.validate(cfg, len(devices if devices is not None else jax.devices()))
        pretrained = pretrained or {}
        self.cfg, self.plan, self.dtype = cfg, plan, compute_dtype
        self.meshes = stage_meshes(plan, devices)
        root = jax.random.key(seed)
        per_stage_trainable, built = {}, {}
        for u in plan.units:
            flags = []
            for v in range(u.pp * u.num_chunks):  # virtual stage v = chunk * pp + stage
                start, end = u.stage_layers(v % u.pp, v // u.pp)
                made = (stage_module, (cfg, u.name, start, end), root,
                        (stage_filter(cfg, u.name), ...))
                _, tr, _ = abstract_split(*made, None)
                flags.append(bool(jax.tree.leaves(tr)))
                built[StageId(u.name, v)] = made
            per_stage_trainable[u.name] = tuple(flags)
        nv = {u.name: u.pp * u.num_chunks for u in plan.units}
        pp = {u.name: u.pp for u in plan.units}
        # stages of the graph are virtual, StageId(unit, chunk * pp + s): what run() walks
        self.graph = StageGraph.from_dag(cfg.units, pp, per_stage_trainable,
                                         {u.name: u.num_chunks for u in plan.units})
        self.num_virtual = nv
        if cfg.llm.tie_embeddings and nv["llm"] > 1 and not all(
                holds_local_device(m) for m in (self.meshes["llm"][0], self.meshes["llm"][-1])):
            raise UserError("tie_embeddings=True with the llm's first and last stage in "
                            "different processes: the embedding group sums their gradients "
                            "within one process (order the plan's devices so both stages sit "
                            "on one host, or use llm pp=1)")
        self.stages: dict[StageId, Stage] = {}
        self._initial: dict | None = {}  # the seed's / pretrained parameters, until taken
        for sid in self.graph.stages:
            mesh = self.meshes[sid.unit][sid.index % plan.unit(sid.unit).pp]
            mode = Backward(self.graph.has_backward[sid])
            up = plan.unit(sid.unit)
            gd, tr, fr = stage_state(*built[sid], mesh)
            if is_vae(sid.unit):  # frozen, whole: the diffusers checkpoint onto its mesh
                fr = load_vae_stage(pretrained, fr, mesh)
            elif "model" in pretrained and not is_generator(sid.unit):
                tr, fr = load_pretrained_stage(cfg, up, sid, pretrained["model"], tr, fr,
                                               True)
            elif sid.unit in pretrained:
                tr, fr = load_pretrained_stage(cfg, up, sid, pretrained[sid.unit], tr, fr)
            st = Stage(sid, mesh, up.dp, gd, abstract_params(tr), fr, mode,
                       local=holds_local_device(mesh))
            st.fns = make_stage_fns(cfg, up, gd, mode, compute_dtype, mesh,
                                    llm_mask_family=llm_mask_family)
            stage_programs(st, compute_dtype)
            self.stages[sid] = st
            self._initial[sid] = tr
        # one row per physical stage, i.e. per mesh (Megatron's interleaved order for units
        # with num_chunks > 1), merged into one dependency-respecting dispatch order; JAX
        # runs each mesh's work in dispatch order, so each mesh executes exactly its row.
        # Entries are (virtual StageId, Action) with Action.chunk the chunk on its mesh.
        self.schedule = multimodal_one_f_one_b(self.graph, plan.num_microbatches)
        self.order = [(self.graph.virtual(s, a.chunk), a)
                      for s, a in dispatch_order(self.schedule, self.graph)]
        # index in `order` of each stage's last backward (its gradients are final there)
        self.last_backward = {sid: i for i, (sid, a) in enumerate(self.order) if a.kind == "B"}
        self.sync = sync_collectives()
        self.transfers = Transfers(self.stages, self.graph, nv["llm"],
                                   cfg.generator is not None, self.sync, dropout_units(cfg))

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

    def _initial_compute(self) -> dict:
        """The compute copy of the initial parameters (a run of the runtime on its own)."""
        if self._initial is None:
            raise ValueError("the runtime's initial parameters were handed to a training "
                             "state: pass `params` (the state's compute copies)")
        return self.compute_params(self._initial)

    def params(self, sid: StageId):
        """The compute copy of stage `sid`'s initial parameters."""
        return self.compute_params({sid: self._initial[sid]})[sid]

    # ---- one step -------------------------------------------------------------------
    def run(self, feeds: list[MicrobatchFeed], params: dict | None = None,
            trace: bool | str = False) -> StepResult:
        """Forward and backward of every microbatch on `params` ({StageId: compute copy};
        None: the initial parameters). Returns device-side losses and the step's gradients
        (`StepResult.grads`). `trace` (pipeline/trace.py): False; True or "serial" (each
        action waited on: isolated costs, no overlap); "overlap" (waiter threads stamp
        completions; dispatch stays free of host syncs)."""
        result, grads = self.start(feeds, params, trace)
        result.partials = dict(grads)
        result.reduced = {sid for sid in result.partials  # ZeRO-2/3: summed shards already
                          if self.stages[sid].fns.zero_stage >= 2}
        return result

    def start(self, feeds: list[MicrobatchFeed], params: dict | None = None,
              trace: bool | str = False, count: int | None = None):
        """`run` as (result, grads): `grads` iterates (StageId, partial gradients) for every
        local stage with trainable parameters, each as soon as the stage's last backward is
        dispatched, so the caller's gradient sync of one stage overlaps the backward work
        the others still have (a tied embedding's two stages come last, once their copies
        are summed). Walking `grads` dispatches the step; `result`'s losses (and trace) are
        complete when it is exhausted. `count`: the applied-step count of a training step
        (LoRA dropout's masks, pipeline/lora_dropout.py); None: no dropout."""
        if len(feeds) != self.plan.num_microbatches:
            raise ValueError(f"got {len(feeds)} microbatch feeds; the plan has "
                             f"{self.plan.num_microbatches}")
        step = _Step(feeds, (sum(f.num_target_tokens for f in feeds),
                             sum(f.num_gen_elements for f in feeds)),
                     self._initial_compute() if params is None else params, count)
        return step.result, self._walk(step, make_tracer(trace_mode(trace)))

    def _walk(self, step: "_Step", tracer):
        step.result.partials = {sid: self.settle(st.zeros())
                                for sid, st in self.stages.items()
                                if st.mode.param_grads and st.local}
        feeds = step.feeds
        tied = self.tied_embedding_stages() or ()
        for i, (sid, act) in enumerate(self.order):
            mb = act.microbatch
            t0 = tracer.start() if tracer else 0.0
            if (sid, mb) not in step.sides:
                step.sides[(sid, mb)] = self.transfers.side(
                    sid, feeds[mb], step.totals, None if step.count is None else (step.count, mb))
            if act.kind == "F":
                self._forward(sid, mb, step)
            else:
                self._backward(sid, mb, step)
            if tracer:
                self._trace(tracer, sid, act, t0, step)
            if act.kind == "B" or not self.graph.runs_backward(sid):
                step.sides.pop((sid, mb), None)
            if (self.last_backward.get(sid) == i and sid not in tied
                    and sid in step.result.partials):
                yield sid, step.result.partials.pop(sid)
        self._sum_tied_embedding_grads(step.result.partials)
        for sid in list(step.result.partials):
            yield sid, step.result.partials.pop(sid)
        if tracer:
            step.result.trace = tracer.finish()

    def evaluate(self, feeds: list[MicrobatchFeed], params: dict | None = None) -> StepResult:
        """The LM loss terms of `feeds` by forward passes alone (validation): every LLM and
        encoder stage's `apply` in the schedule's forward order, nothing kept for a backward
        and no gradients; the generator (diffusion loss) is not run. `losses()["lm_loss"]`
        is the feeds' mean loss per trained token, as in `run`. `params`: as in `run`."""
        step = _Step(feeds, (sum(f.num_target_tokens for f in feeds),
                             sum(f.num_gen_elements for f in feeds)),
                     self._initial_compute() if params is None else params)
        last_llm = StageId(LLM_UNIT, self.num_virtual["llm"] - 1)
        for sid, act in self.order:
            if act.kind != "F" or is_generator(sid.unit) or is_vae(sid.unit):
                continue
            mb, st = act.microbatch, self.stages[sid]
            side = self.transfers.side(sid, feeds[mb], step.totals)
            x = self.transfers.gather_input(sid, mb, step.outputs, feeds[mb])
            if st.local:
                y = self.settle(st.fns.apply(step.params[sid], st.frozen, x, side))
            else:
                y = jax.eval_shape(st.fns.apply, st.abstract, st.frozen, x, side)
            if sid == last_llm:
                step.result.lm_loss.append(y[0] if self.cfg.generator is not None else y)
            else:
                step.outputs[(sid, mb)] = y
            for p in self.graph.predecessors(sid):  # inputs are read once: free them
                step.outputs.pop((p, mb), None)
        return step.result

    def _forward(self, sid: StageId, mb: int, step: "_Step"):
        st, side = self.stages[sid], step.sides[(sid, mb)]
        x = self.transfers.gather_input(sid, mb, step.outputs, step.feeds[mb])
        if st.local:  # keep the vjp residuals (pipeline/stage.py), not the input
            y, res = self.settle(st.fns.forward(step.params[sid], st.frozen, x, side))
        else:  # another process runs it; keep the shapes for the transfers and dx
            y, _ = jax.eval_shape(st.fns.forward, st.abstract, st.frozen, x, side)
            res = abstract(x)
        if self.graph.runs_backward(sid):
            step.residuals[(sid, mb)] = res
        del x
        if sid == StageId(LLM_UNIT, self.num_virtual["llm"] - 1):
            lm, y = (y if self.cfg.generator is not None else (y, None))
            step.result.lm_loss.append(lm)
        elif is_generator(sid.unit) and not self.graph.successors(sid):
            step.result.diffusion_loss.append(y)
            y = None
        step.outputs[(sid, mb)] = y

    def _backward(self, sid: StageId, mb: int, step: "_Step"):
        st, side = self.stages[sid], step.sides[(sid, mb)]
        dy = self.transfers.gather_cotangent(sid, mb, step.cotangents, step.feeds[mb])
        res = step.residuals.pop((sid, mb))
        grads = step.result.partials
        if st.local:
            acc, dx = self.settle(st.fns.backward(step.params[sid], st.frozen, side, res, dy,
                                                  grads.get(sid, {})))
            if sid in grads:
                grads[sid] = acc
        else:  # a cotangent has its primal's shape and dtype (res = abstract(x))
            dx = res if st.mode.input_grads else None
        st.backward_calls += 1
        if dx is not None:
            step.cotangents[(sid, mb)] = dx

    def _trace(self, tracer, sid: StageId, act, t0: float, step: "_Step"):
        st, mb = self.stages[sid], act.microbatch
        done = None
        if st.local:
            done = ((step.outputs.get((sid, mb)), step.residuals.get((sid, mb)))
                    if act.kind == "F" else
                    (step.cotangents.get((sid, mb)), step.result.partials.get(sid)))
            done = completion_marker(done)
        phys = StageId(sid.unit, sid.index % self.plan.unit(sid.unit).pp)
        tracer.done(str(phys), {"stage": str(phys), "kind": act.kind, "microbatch": mb,
                                "chunk": act.chunk, "virtual_stage": str(sid)}, t0, done)

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
