"""Host-driven MPMD pipeline runtime over the unit DAG (docs/design.md "Execute the schedule").

Every stage of every unit lives on its own sub-mesh with its own jitted forward/backward
(pipeline/stage.py). `PipelineRuntime.run` walks the schedule (schedule/schedule.py) in a
dependency-respecting global order, moving activations and gradients between stages through
the broker; JAX's async dispatch lets stages on disjoint devices run concurrently, and the
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
import numpy as np
from flax import nnx

from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.models.hf import pretrained as hf_pretrained
from mmjax.models.mllm import trainable_filter
from mmjax.data.routes import Routes
from mmjax.parallel.broker import Broker
from mmjax.parallel.mesh import stage_meshes
from mmjax.models.layers import cast_floats
from mmjax.models.units import LLM_UNIT, is_encoder, is_generator, is_llm
from mmjax.parallel.tensor import state_shardings
from mmjax.parallel.zero_shards import zero_shardings
from mmjax.data.feed import MicrobatchFeed
from mmjax.schedule.stage_graph import Backward, StageGraph, StageId
from mmjax.schedule.dependencies import dispatch_order
from mmjax.schedule.schedule import multimodal_one_f_one_b
from mmjax.parallel.sharded_init import abstract_split, init_split
from mmjax.pipeline.stage import dp_sharding, make_stage_fns, partial_shardings
from mmjax.pipeline.stage_modules import stage_module
from mmjax.pipeline.multiprocess import (abstract, global_put, holds_local_device,
                                         place_state, placeholders, sync_collectives)
from mmjax.pipeline.step_result import StepResult
from mmjax.pipeline.trace import completion_marker, make_tracer, trace_mode
from mmjax.planner.plan import Plan


def _stage_filter(cfg: MLLMConfig, unit: str):
    if not is_encoder(unit):  # the LLM's or the generator's module alone
        return nnx.Nothing if cfg.frozen(unit) else nnx.Param
    return trainable_filter(cfg)


EAGER_INIT_BYTES = 256 << 20  # smaller stages are built eagerly and placed (no compile)


def _stage_state(make_module, args, key, filters, mesh):
    """(graphdef, trainable, frozen) of a stage on its mesh. A stage of EAGER_INIT_BYTES or
    more is made by one jitted program straight into its shards (parallel/sharded_init.py:
    no process ever holds it whole); a smaller one is built eagerly and placed, which
    costs no compile per stage and device assignment (2-4 s each on CPU); both give the
    same bits. A mesh wholly in other processes: shapes and shardings only."""
    if not holds_local_device(mesh):
        return abstract_split(make_module, args, key, filters, mesh)
    _, *abstract = abstract_split(make_module, args, key, filters)
    if sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)) >= EAGER_INIT_BYTES:
        return init_split(make_module, args, key, filters, mesh)
    graphdef, *states = nnx.split(make_module(*args, key), *filters)
    return (graphdef, *(place_state(st, mesh) for st in states))


@dataclass
class Stage:
    """One stage's fixed parts: its mesh, module structure, frozen parameters and programs.
    `abstract`: the trainable parameters' shapes, dtypes and (placed) shardings; the values
    live in the training state (train/state.py)."""

    id: StageId
    mesh: jax.sharding.Mesh
    dp: int
    graphdef: object
    abstract: object
    frozen: object
    mode: Backward
    fns: object = None
    backward_calls: int = 0    # backward programs dispatched (a diagnostic count)
    local: bool = True  # the mesh holds a device of this process
    gather: object = None      # jitted trainable -> compute (cast, all-gather over dp)
    zeros: object = None       # jitted () -> zero partial-gradient accumulators [dp, ...]


@dataclass
class _Step:
    """The in-flight state of one `run`: per (stage, microbatch) host inputs, forward
    outputs, residuals and cotangents; the result being filled."""

    feeds: list
    totals: tuple
    params: dict
    sides: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    residuals: dict = field(default_factory=dict)
    cotangents: dict = field(default_factory=dict)
    result: StepResult = field(default_factory=StepResult)


def _abstract(tree):
    """Shapes, dtypes and shardings of `tree`'s arrays (what a stage keeps of its
    parameters)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                       sharding=a.sharding),
                        tree)


def _load_pretrained(cfg: MLLMConfig, up, sid: StageId, path, tr, fr, whole: bool = False):
    """A stage's placed states with its layers of the HF checkpoint at `path` (`whole`: a
    whole-model LLaVA checkpoint, `pretrained.model`)."""
    start, end = up.stage_layers(sid.index % up.pp, sid.index // up.pp)
    plan, root = hf_pretrained.stage_load_plan(path, cfg, sid.unit, start, end, whole)
    tr, fr = (hf_pretrained.load_stage_state(tr, plan, root),
              hf_pretrained.load_stage_state(fr, plan, root))
    proj = None if whole else hf_pretrained.projector_plan(path, cfg, sid.unit)  # Qwen2-VL
    if proj is not None and end == cfg.num_layers(sid.unit):  # the merger, on the last stage
        root = ("projectors", sid.unit)
        tr, fr = (hf_pretrained.load_stage_state(tr, proj, root),
                  hf_pretrained.load_stage_state(fr, proj, root))
    return tr, fr


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
                        (_stage_filter(cfg, u.name), ...))
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
            gd, tr, fr = _stage_state(*built[sid], mesh)
            if "model" in pretrained and not is_generator(sid.unit):
                tr, fr = _load_pretrained(cfg, up, sid, pretrained["model"], tr, fr, True)
            elif sid.unit in pretrained:
                tr, fr = _load_pretrained(cfg, up, sid, pretrained[sid.unit], tr, fr)
            st = Stage(sid, mesh, up.dp, gd, _abstract(tr), fr, mode,
                       local=holds_local_device(mesh))
            st.fns = make_stage_fns(cfg, up, gd, mode, compute_dtype, mesh,
                                    llm_mask_family=llm_mask_family)
            self._stage_programs(st)
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
        self.brokers: dict[tuple[StageId, StageId], Broker] = {}
        self.sync = sync_collectives()

    # ---- parameters -------------------------------------------------------------------
    def _stage_programs(self, st: Stage) -> None:
        """The stage's parameter programs: `gather` (fp32 params in any dp sharding -> the
        compute copy: compute dtype, replicated over dp, TP-sharded) and `zeros` (the step's
        float32 partial-gradient accumulators `[ranks, ...]`, ranks = dp or dp * cp)."""
        zero, zmesh = st.fns.zero_stage, st.fns.zero_mesh  # ZeRO-2/3: shard accumulators,
        compute_sh = (zero_shardings(st.abstract, zmesh) if zero == 3  # ZeRO-3 the weights
                      else state_shardings(st.abstract, st.mesh))
        dtype = self.dtype
        st.gather = jax.jit(lambda t: cast_floats(t, dtype), out_shardings=compute_sh)
        if zero == 3 and st.local:
            st.frozen = jax.device_put(st.frozen, zero_shardings(st.frozen, zmesh))
        if st.mode.param_grads:
            abstract_tr = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                       st.abstract)
            ranks = () if zero >= 2 else (st.fns.ranks,)
            sh = (zero_shardings(abstract_tr, zmesh) if zero >= 2
                  else partial_shardings(abstract_tr, st.mesh))
            st.zeros = jax.jit(lambda: jax.tree.map(
                lambda a: jnp.zeros(ranks + tuple(a.shape), jnp.float32), abstract_tr),
                out_shardings=sh)

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

    # ---- structure ------------------------------------------------------------------
    def broker(self, src: StageId, dst: StageId) -> Broker:
        key = (src, dst)
        if key not in self.brokers:
            self.brokers[key] = Broker(self.stages[src].mesh, self.stages[dst].mesh)
        return self.brokers[key]

    def _routes(self, src: StageId, dst: StageId, feed: MicrobatchFeed) -> Routes:
        if src.unit == dst.unit:
            return Routes.identity(self.stages[src].dp)
        if is_llm(dst.unit):
            return feed.enc_routes[src.unit]
        return feed.gen_routes

    # ---- host inputs ----------------------------------------------------------------
    def _put(self, sid: StageId, tree):
        st = self.stages[sid]
        if not st.local:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                                tree)
        mesh = st.mesh
        return global_put(tree, jax.tree.map(
            lambda a: dp_sharding(mesh, np.ndim(a)) if np.ndim(a) else
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), tree))

    def _side(self, sid: StageId, feed: MicrobatchFeed, totals):
        u = sid.unit
        if is_llm(u):
            side = {"llm": feed.llm, "num_tokens": np.float32(max(totals[0], 1))}
            if self.cfg.generator is not None:
                side["gen_pack"] = feed.gen_pack
            return self._put(sid, side)
        if is_generator(u):
            return self._put(sid, {"gen": feed.gen, "num_gen": np.float32(max(totals[1], 1))})
        return self._put(sid, {"inputs": feed.enc_inputs[u], "pack": feed.enc_pack[u]})

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
              trace: bool | str = False):
        """`run` as (result, grads): `grads` iterates (StageId, partial gradients) for every
        local stage with trainable parameters, each as soon as the stage's last backward is
        dispatched, so the caller's gradient sync of one stage overlaps the backward work
        the others still have (a tied embedding's two stages come last, once their copies
        are summed). Walking `grads` dispatches the step; `result`'s losses (and trace) are
        complete when it is exhausted."""
        if len(feeds) != self.plan.num_microbatches:
            raise ValueError(f"got {len(feeds)} microbatch feeds; the plan has "
                             f"{self.plan.num_microbatches}")
        step = _Step(feeds, (sum(f.num_target_tokens for f in feeds),
                             sum(f.num_gen_elements for f in feeds)),
                     self._initial_compute() if params is None else params)
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
                step.sides[(sid, mb)] = self._side(sid, feeds[mb], step.totals)
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
            if act.kind != "F" or is_generator(sid.unit):
                continue
            mb, st = act.microbatch, self.stages[sid]
            side = self._side(sid, feeds[mb], step.totals)
            x = self._gather_input(sid, mb, step.outputs, feeds[mb])
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
        x = self._gather_input(sid, mb, step.outputs, step.feeds[mb])
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
        dy = self._gather_cotangent(sid, mb, step.cotangents, step.feeds[mb])
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

    def _gather_input(self, sid, mb, outputs, feed):
        preds = self.graph.predecessors(sid)
        if not preds:
            return None
        if is_llm(sid.unit) and sid.index == 0:
            return {p.unit: self._move(p, sid, outputs[(p, mb)], feed) for p in preds}
        (p,) = preds
        return self._move(p, sid, outputs[(p, mb)], feed)

    def settle(self, out):
        """On multi-process CPU runs, finish each dispatch before the next (see module
        docstring); otherwise a no-op, keeping the loop free of host syncs."""
        return jax.block_until_ready(out) if self.sync else out

    def _move(self, src, dst, x, feed, inverse=False):
        """Broker transfer src -> dst. Within a unit every dp rank's whole block is one part
        (viewed as [dp, block, ...] for the transfer); between units the feed's routes.
        A process with devices on neither side skips it (shapes only); one with none on the
        source side sends no-shard placeholders, one with none on the destination side
        keeps the result's shapes."""
        routes = (self._routes(src, dst, feed) if not inverse
                  else self._routes(dst, src, feed).inverse())
        src_local, dst_local = self.stages[src].local, self.stages[dst].local
        intra = src.unit == dst.unit
        if not (src_local or dst_local):
            if intra:
                return abstract(x)
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                (routes.dst_ranks * routes.dst_slots,) + tuple(a.shape[1:]), a.dtype), x)
        dp = self.stages[src].dp
        broker = self.broker(src, dst)
        if intra:
            x = jax.tree.map(lambda a: a.reshape((dp, -1) + a.shape[1:]) if src_local else
                             jax.ShapeDtypeStruct((dp, a.shape[0] // dp) + tuple(a.shape[1:]),
                                                  a.dtype), x)
        if not src_local:
            x = placeholders(x, broker.src_sharding)
        moved = broker.transfer_tree(x, routes, wait=self.sync)
        if not dst_local:
            moved = abstract(moved)
        if not intra:
            return moved
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]) if dst_local else
                            jax.ShapeDtypeStruct((a.shape[0] * a.shape[1],) + tuple(a.shape[2:]),
                                                 a.dtype), moved)

    def _gather_cotangent(self, sid, mb, cotangents, feed):
        succ = [s for s in self.graph.successors(sid) if self.graph.runs_backward(s)]
        moved = []
        for s in succ:
            dx = cotangents[(s, mb)]
            if is_llm(s.unit) and s.index == 0 and not is_llm(sid.unit):
                dx = dx[sid.unit]
            moved.append(self._move(s, sid, dx, feed, inverse=True))
        one = self._one(sid)
        if is_llm(sid.unit) and not self.graph.successors(sid):
            return one
        if is_llm(sid.unit) and sid.index == self.num_virtual["llm"] - 1:
            (dcond,) = moved if moved else (None,)
            if dcond is None:
                raise RuntimeError("internal: the last LLM stage runs backward but the "
                                   "generator does not; the frozen rule makes this impossible")
            return (one, dcond)
        if is_generator(sid.unit) and not self.graph.successors(sid):
            return one
        (d,) = moved
        return d

    def _one(self, sid):
        """The loss cotangent 1.0 per dp rank, `[dp]` on the stage mesh's dp axis."""
        st = self.stages[sid]
        return global_put(np.ones((st.dp,), np.float32), dp_sharding(st.mesh, 1))


