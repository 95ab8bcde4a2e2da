"""Host-driven MPMD pipeline runtime over the unit DAG (docs/design.md "Execute the schedule").

Every stage of every unit lives on its own sub-mesh with its own jitted forward/backward
(pipeline/stage.py). `PipelineRuntime.run` walks the schedule (pipeline/schedule.py
`multimodal_one_f_one_b`) in a dependency-respecting global order, moving activations
forward and gradients backward between stages through the broker; JAX's async dispatch
lets stages on disjoint devices run concurrently. The loop makes no host sync: losses stay
device arrays until the caller reads them. Gradients are accumulated per stage over
microbatches (each backward all-reduces over its dp axis through GSPMD).

Multi-process (docs/design.md "Units, stages and sub-meshes"; DistTrain §7): every process walks
the same order. A process runs a stage's jitted functions only when the stage mesh holds
one of its devices (all processes of a mesh spanning several call it); for other stages it
keeps `jax.eval_shape` results (ShapeDtypeStructs) so that it can still take part in every
broker transfer touching its devices, which all processes issue in the same order. Host
inputs go only to addressable devices (`make_array_from_callback` for meshes spanning
processes). On CPU (gloo) two cross-process collectives in flight can deadlock, so there each
dispatch is waited on; single-process runs stay free of host syncs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.data.assemble import AssemblyLayout
from mmjax.models.config import MLLMConfig
from mmjax.models.hf import pretrained as hf_pretrained
from mmjax.models.mllm import trainable_filter
from mmjax.parallel.broker import Broker, Routes
from mmjax.parallel.mesh import stage_meshes
from mmjax.parallel.tensor import shard_state, state_shardings
from mmjax.pipeline.feed import MicrobatchFeed, PartMap
from mmjax.pipeline.schedule import StageGraph, StageId, dispatch_order, multimodal_one_f_one_b
from mmjax.pipeline.stage import build_stage_module, dp_sharding, make_stage_fns
from mmjax.pipeline.trace import completion_marker, make_tracer, trace_mode
from mmjax.planner.plan import Plan


def to_routes(pm: PartMap) -> Routes:
    return Routes.from_pairs(pm.src_ranks, pm.src_slots, pm.dst_ranks, pm.dst_slots,
                             pm.pairs)


def _stage_filter(cfg: MLLMConfig, unit: str):
    if unit == "llm":
        return nnx.Nothing if cfg.llm_frozen else nnx.Param
    if unit == "generator":
        return nnx.Nothing if cfg.generator_frozen else nnx.Param
    return trainable_filter(cfg)


@dataclass
class Stage:
    id: StageId
    mesh: jax.sharding.Mesh
    dp: int
    graphdef: object
    trainable: object
    frozen: object
    mode: str  # full / params / input_only / none
    fns: object = None
    backward_calls: int = 0
    grads: object = None
    local: bool = True  # the mesh holds a device of this process


def holds_local_device(mesh) -> bool:
    return any(d.process_index == jax.process_index() for d in mesh.devices.flat)


def sync_collectives() -> bool:
    """True on multi-process CPU runs: gloo may deadlock with two collectives in flight."""
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def global_put(tree, shardings):
    """`device_put` for shardings that may span processes: each process fills only its
    addressable shards from the (identical on every host) host value."""
    def one(x, sh):
        if sh.is_fully_addressable:
            return jax.device_put(x, sh)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda idx: host[idx],
                                            dtype=host.dtype)
    return jax.tree.map(one, tree, shardings)


def abstract(tree):
    """Shapes and dtypes only (values held by other processes)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), tree)


def _placed(tree, sharding):
    """Arrays with no addressable shard (this process owns none of `sharding`'s devices), to
    stand for another process's values in a broker transfer."""
    return jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
        a.shape, sharding, [], dtype=a.dtype), tree)


@dataclass
class StepResult:
    """Per-microbatch loss terms as device scalars (on the last stages' meshes); reading
    them (`losses()`) is the step's one host sync, after the whole schedule is dispatched."""

    lm_loss: list = field(default_factory=list)
    diffusion_loss: list = field(default_factory=list)
    trace: list = field(default_factory=list)

    def losses(self) -> dict[str, float]:
        if jax.process_count() == 1:
            lm_terms = jax.device_get(self.lm_loss)
            diff_terms = jax.device_get(self.diffusion_loss)
        else:
            lm_terms, diff_terms = gather_scalars([self.lm_loss, self.diffusion_loss])
        lm = float(sum(np.asarray(v, np.float64) for v in lm_terms))
        diff = float(sum(np.asarray(v, np.float64) for v in diff_terms))
        return {"loss": lm + diff, "lm_loss": lm, "diffusion_loss": diff}


def gather_scalars(groups: list[list]) -> list[np.ndarray]:
    """Replicated device scalars, some held by other processes (ShapeDtypeStructs here), ->
    their values on every process: the lowest process holding each scalar contributes it,
    the others zero, and one `process_allgather` sums the contributions (exact)."""
    from jax.experimental import multihost_utils

    flat = [v for g in groups for v in g]
    mine = np.zeros(len(flat), np.float32)
    for k, v in enumerate(flat):
        if isinstance(v, jax.Array) and v.addressable_shards and jax.process_index() == min(
                d.process_index for d in v.sharding.device_set):
            mine[k] = np.asarray(v.addressable_shards[0].data)
    total = np.asarray(multihost_utils.process_allgather(mine)).sum(axis=0)
    out, k = [], 0
    for g in groups:
        out.append(total[k:k + len(g)])
        k += len(g)
    return out


def _place(state, mesh):
    """Stage state on its mesh with the Megatron shardings; for a mesh wholly in other
    processes, ShapeDtypeStructs carrying those shardings (enough for `jax.eval_shape`)."""
    here = [d.process_index == jax.process_index() for d in mesh.devices.flat]
    if all(here):
        return shard_state(state, mesh)
    shardings = state_shardings(state, mesh)
    if not any(here):
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh),
                            state, shardings)
    return global_put(state, shardings)


def _load_pretrained(cfg: MLLMConfig, up, sid: StageId, path, tr, fr):
    """A stage's placed states with its layers of the HF checkpoint at `path`."""
    start, end = up.stage_layers(sid.index % up.pp, sid.index // up.pp)
    plan = hf_pretrained.load_plan(path, hf_pretrained.unit_config(cfg, sid.unit), start, end)
    root = () if sid.unit == "llm" else ("encoders", sid.unit)
    return (hf_pretrained.load_stage_state(tr, plan, root),
            hf_pretrained.load_stage_state(fr, plan, root))


class PipelineRuntime:
    def __init__(self, cfg: MLLMConfig, plan: Plan, devices=None, seed: int = 0,
                 compute_dtype=jnp.float32, pretrained: dict | None = None):
        """`pretrained` {unit: HF checkpoint directory}: each stage of those units reads
        its own layers (its devices' blocks) straight onto its sub-mesh after placement;
        `cfg` must already describe them (`hf.pretrained_config`)."""
        plan.validate(cfg, len(devices if devices is not None else jax.devices()))
        pretrained = pretrained or {}
        self.cfg, self.plan, self.dtype = cfg, plan, compute_dtype
        self.meshes = stage_meshes(plan, devices)
        root = jax.random.key(seed)
        with_gen = cfg.generator is not None
        per_stage_trainable, built = {}, {}
        for u in plan.units:
            flags = []
            for v in range(u.pp * u.num_chunks):  # virtual stage v = chunk * pp + stage
                start, end = u.stage_layers(v % u.pp, v // u.pp)
                module = build_stage_module(cfg, u.name, root, start, end)
                gd, tr, fr = nnx.split(module, _stage_filter(cfg, u.name), ...)
                flags.append(bool(jax.tree.leaves(tr)))
                built[StageId(u.name, v)] = (gd, tr, fr)
            per_stage_trainable[u.name] = tuple(flags)
        nv = {u.name: u.pp * u.num_chunks for u in plan.units}
        pp = {u.name: u.pp for u in plan.units}
        enc = {n: k for n, k in pp.items() if n not in ("llm", "generator")}
        # stages of the graph are virtual, StageId(unit, chunk * pp + s): what run() walks
        self.graph = StageGraph.from_units(enc, pp["llm"], pp.get("generator", 0),
                                           per_stage_trainable,
                                           {u.name: u.num_chunks for u in plan.units})
        self.num_virtual = nv
        if cfg.llm.tie_embeddings and nv["llm"] > 1 and not all(
                holds_local_device(m) for m in (self.meshes["llm"][0], self.meshes["llm"][-1])):
            raise ValueError("tie_embeddings=True with the llm's first and last stage in "
                             "different processes is not supported (the embedding group sums "
                             "their gradients in one process): place both in one process or "
                             "use llm pp=1")
        self.stages: dict[StageId, Stage] = {}
        for sid in self.graph.stages:
            gd, tr, fr = built[sid]
            mesh = self.meshes[sid.unit][sid.index % plan.unit(sid.unit).pp]
            mode = self.graph.has_backward[sid]
            if mode == "full" and not self._needs_dx(sid):
                mode = "params"
            up = plan.unit(sid.unit)
            tr, fr = _place(tr, mesh), _place(fr, mesh)
            if sid.unit in pretrained:
                tr, fr = _load_pretrained(cfg, up, sid, pretrained[sid.unit], tr, fr)
            st = Stage(sid, mesh, up.dp, gd, tr, fr, mode, local=holds_local_device(mesh))
            st.fns = make_stage_fns(cfg, sid.unit, gd, mode, compute_dtype, with_gen, st.dp, mesh,
                                    up.overlap_tp, up.remat, up.tp_chunks, up.tp_bidirectional,
                                    up.cp_head_groups)
            self.stages[sid] = st
        # one row per physical stage, i.e. per mesh (Megatron's interleaved order for units
        # with num_chunks > 1), merged into one dependency-respecting dispatch order; JAX
        # runs each mesh's work in dispatch order, so each mesh executes exactly its row.
        # Entries are (virtual StageId, Action) with Action.chunk the chunk on its mesh.
        self.schedule = multimodal_one_f_one_b(self.graph, plan.num_microbatches)
        self.order = [(self.graph.virtual(s, a.chunk), a)
                      for s, a in dispatch_order(self.schedule, self.graph)]
        self.brokers: dict[tuple[StageId, StageId], Broker] = {}
        self.sync = sync_collectives()

    # ---- structure ------------------------------------------------------------------
    def _needs_dx(self, sid: StageId) -> bool:
        return any(self.graph.runs_backward(p) for p in self.graph.predecessors(sid))

    def broker(self, src: StageId, dst: StageId) -> Broker:
        key = (src, dst)
        if key not in self.brokers:
            self.brokers[key] = Broker(self.stages[src].mesh, self.stages[dst].mesh)
        return self.brokers[key]

    def _routes(self, src: StageId, dst: StageId, feed: MicrobatchFeed) -> PartMap:
        if src.unit == dst.unit:
            return PartMap.identity(self.stages[src].dp)
        if dst.unit == "llm":
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
        if u == "llm":
            side = {"llm": feed.llm, "num_tokens": np.float32(max(totals[0], 1))}
            if self.cfg.generator is not None:
                side["gen_pack"] = feed.gen_pack
            return self._put(sid, side)
        if u == "generator":
            return self._put(sid, {"gen": feed.gen, "num_gen": np.float32(max(totals[1], 1))})
        return self._put(sid, {"inputs": feed.enc_inputs[u], "pack": feed.enc_pack[u]})

    # ---- one step -------------------------------------------------------------------
    def run(self, feeds: list[MicrobatchFeed], trace: bool | str = False) -> StepResult:
        """Forward and backward of every microbatch; gradients accumulate in
        `stage.grads`. Returns device-side losses. `trace` (pipeline/trace.py): False; True
        or "serial" (each action waited on: isolated costs, no overlap); "overlap" (waiter
        threads stamp completions; dispatch stays free of host syncs)."""
        tracer = make_tracer(trace_mode(trace))
        if len(feeds) != self.plan.num_microbatches:
            raise ValueError(f"got {len(feeds)} microbatch feeds; the plan has "
                             f"{self.plan.num_microbatches}")
        totals = (sum(f.num_target_tokens for f in feeds), sum(f.num_gen_elements for f in feeds))
        for st in self.stages.values():
            st.grads = (jax.tree.map(jnp.zeros_like, st.trainable)
                        if st.mode in ("full", "params") and st.local else None)
        sides, residuals, outputs, cotangents = {}, {}, {}, {}
        result = StepResult()
        last_llm = StageId("llm", self.num_virtual["llm"] - 1)
        has_gen = self.cfg.generator is not None
        for sid, act in self.order:
            st, mb = self.stages[sid], act.microbatch
            t0 = tracer.start() if tracer else 0.0
            if (sid, mb) not in sides:
                sides[(sid, mb)] = self._side(sid, feeds[mb], totals)
            side = sides[(sid, mb)]
            if act.kind == "F":
                x = self._gather_input(sid, mb, outputs, feeds[mb])
                if st.local:  # keep the vjp residuals (pipeline/stage.py), not the input
                    y, res = self.settle(st.fns.forward(st.trainable, st.frozen, x, side))
                else:  # another process runs it; keep the shapes for the transfers and dx
                    y, _ = jax.eval_shape(st.fns.forward, st.trainable, st.frozen, x, side)
                    res = abstract(x)
                if self.graph.runs_backward(sid):
                    residuals[(sid, mb)] = res
                del x
                if sid == last_llm:
                    lm, y = (y if has_gen else (y, None))
                    result.lm_loss.append(lm)
                elif sid.unit == "generator" and not self.graph.successors(sid):
                    result.diffusion_loss.append(y)
                    y = None
                outputs[(sid, mb)] = y
            else:
                dy = self._gather_cotangent(sid, mb, cotangents, feeds[mb])
                res = residuals.pop((sid, mb))
                if st.local:
                    grads, dx = self.settle(st.fns.backward(
                        st.trainable, st.frozen, side, res, dy,
                        st.grads if st.grads is not None else {}))
                    if st.grads is not None:
                        st.grads = grads
                else:  # a cotangent has its primal's shape and dtype (res = abstract(x))
                    dx = res if st.mode in ("full", "input_only") else None
                st.backward_calls += 1
                if dx is not None:
                    cotangents[(sid, mb)] = dx
            if tracer:
                done = None
                if st.local:
                    done = ((outputs.get((sid, mb)), residuals.get((sid, mb))) if act.kind == "F"
                            else (cotangents.get((sid, mb)), st.grads))
                    done = completion_marker(done)
                u = self.plan.unit(sid.unit)
                phys = StageId(sid.unit, sid.index % u.pp)
                tracer.done(str(phys), {"stage": str(phys), "kind": act.kind, "microbatch": mb,
                                        "chunk": act.chunk, "virtual_stage": str(sid)},
                            t0, done)
            if act.kind == "B" or not self.graph.runs_backward(sid):
                sides.pop((sid, mb), None)
        self._sum_tied_embedding_grads()
        if tracer:
            result.trace = tracer.finish()
        return result

    def tied_embedding_stages(self) -> tuple[StageId, StageId] | None:
        """(first, last) LLM stage when both hold a copy of a tied embedding, else None."""
        n = self.num_virtual["llm"]
        if not self.cfg.llm.tie_embeddings or n == 1:
            return None
        return StageId("llm", 0), StageId("llm", n - 1)

    def _sum_tied_embedding_grads(self) -> None:
        """Megatron's embedding group: a tied LLM over several stages keeps the embedding on
        its first stage (input) and last stage (LM head); each copy gets the sum of both
        gradients every step, so copies that start equal stay equal, and equal the single
        model's embedding (its gradient is that sum)."""
        pair = self.tied_embedding_stages()
        if pair is None:
            return
        first, last = (self.stages[s] for s in pair)
        if first.grads is None or last.grads is None:  # a frozen LLM: nothing to sum
            return
        a, b = nnx.to_pure_dict(first.grads), nnx.to_pure_dict(last.grads)
        total = a["embed"] + jax.device_put(b["embed"], a["embed"].sharding)
        a["embed"], b["embed"] = total, jax.device_put(total, b["embed"].sharding)
        nnx.replace_by_pure_dict(first.grads, a)
        nnx.replace_by_pure_dict(last.grads, b)

    def _gather_input(self, sid, mb, outputs, feed):
        preds = self.graph.predecessors(sid)
        if not preds:
            return None
        if sid.unit == "llm" and sid.index == 0:
            return {p.unit: self._move(p, sid, outputs[(p, mb)], feed) for p in preds}
        (p,) = preds
        return self._move(p, sid, outputs[(p, mb)], feed)

    def settle(self, out):
        """On multi-process CPU runs, finish each dispatch before the next (see module
        docstring); otherwise a no-op, keeping the loop free of host syncs."""
        return jax.block_until_ready(out) if self.sync else out

    def _move(self, src, dst, x, feed, inverse=False):
        """Broker transfer src -> dst. Within a unit every dp rank's whole block is one part
        (viewed as [dp, block, ...] for the transfer); between units the feed's part maps.
        A process with devices on neither side skips it (shapes only); one with none on the
        source side sends no-shard placeholders, one with none on the destination side
        keeps the result's shapes."""
        routes = to_routes(self._routes(src, dst, feed) if not inverse
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
            x = _placed(x, broker.src_sharding)
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
            if s.unit == "llm" and s.index == 0 and sid.unit != "llm":
                dx = dx[sid.unit]
            moved.append(self._move(s, sid, dx, feed, inverse=True))
        one = self._one(sid)
        if sid.unit == "llm" and not self.graph.successors(sid):
            return one
        if sid.unit == "llm" and sid.index == self.num_virtual["llm"] - 1:
            (dcond,) = moved if moved else (None,)
            if dcond is None:  # generator runs no backward: no gradient flows into cond
                dcond = self._zero_cond(sid, mb)
            return (one, dcond)
        if sid.unit == "generator" and not self.graph.successors(sid):
            return one
        (d,) = moved
        return d

    def _one(self, sid):
        """The loss cotangent 1.0 (on the stage mesh when that spans processes)."""
        mesh = self.stages[sid].mesh
        if all(d.process_index == jax.process_index() for d in mesh.devices.flat):
            return jnp.ones((), jnp.float32)
        return global_put(np.ones((), np.float32), jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec()))

    def _zero_cond(self, sid, mb):
        raise RuntimeError("internal: last LLM stage runs backward but the generator does "
                           "not; the frozen rule makes this impossible")


def _offset_layers(tree: dict, start: int) -> dict:
    out = dict(tree)
    if "layers" in out:
        out["layers"] = {int(k) + start: v for k, v in out["layers"].items()}
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def to_reference_layout(plan: Plan, trees: dict) -> dict:
    """Per-stage pure dicts (StageId -> nnx pure dict) -> one pure dict laid out like
    `MultimodalModel` (layers renumbered globally), for parity checks and checkpoints."""
    out: dict = {}
    for sid, tree in trees.items():
        u = plan.unit(sid.unit)
        start, _ = u.stage_layers(sid.index % u.pp, sid.index // u.pp)
        if sid.unit in ("llm", "generator"):
            part = {sid.unit: _offset_layers(tree, start)}
        else:
            part = {}
            if "encoders" in tree:
                part["encoders"] = {sid.unit: _offset_layers(tree["encoders"][sid.unit], start)}
            if "projectors" in tree:
                part["projectors"] = tree["projectors"]
        out = _deep_merge(out, part)
    return out
