"""Host-driven MPMD pipeline runtime over the unit DAG (DESIGN.md "Execute the schedule").

Every stage of every unit lives on its own sub-mesh with its own jitted forward/backward
(pipeline/stage.py). `PipelineRuntime.run` walks the schedule (pipeline/schedule.py
`multimodal_one_f_one_b`) in a dependency-respecting global order, moving activations
forward and gradients backward between stages through the broker; JAX's async dispatch
lets stages on disjoint devices run concurrently. The loop makes no host sync: losses stay
device arrays until the caller reads them. Gradients are accumulated per stage over
microbatches (each backward all-reduces over its dp axis through GSPMD).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.data.assemble import AssemblyLayout
from mmjax.models.config import MLLMConfig
from mmjax.models.mllm import trainable_filter
from mmjax.parallel.broker import Broker, Routes
from mmjax.parallel.mesh import stage_meshes
from mmjax.parallel.tensor import shard_state
from mmjax.pipeline.feed import MicrobatchFeed, PartMap
from mmjax.pipeline.schedule import Action, StageGraph, StageId, multimodal_one_f_one_b
from mmjax.pipeline.simulate import simulate
from mmjax.pipeline.stage import build_stage_module, dp_sharding, make_stage_fns
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


@dataclass
class StepResult:
    """Per-microbatch loss terms as device scalars (on the last stages' meshes); reading
    them (`losses()`) is the step's one host sync, after the whole schedule is dispatched."""

    lm_loss: list = field(default_factory=list)
    diffusion_loss: list = field(default_factory=list)
    trace: list = field(default_factory=list)

    def losses(self) -> dict[str, float]:
        lm = float(sum(np.asarray(v, np.float64) for v in jax.device_get(self.lm_loss)))
        diff = float(sum(np.asarray(v, np.float64) for v in jax.device_get(self.diffusion_loss)))
        return {"loss": lm + diff, "lm_loss": lm, "diffusion_loss": diff}


class PipelineRuntime:
    def __init__(self, cfg: MLLMConfig, plan: Plan, devices=None, seed: int = 0,
                 compute_dtype=jnp.float32):
        plan.validate(cfg, len(devices if devices is not None else jax.devices()))
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
        enc = {n: k for n, k in nv.items() if n not in ("llm", "generator")}
        self.graph = StageGraph.from_units(enc, nv["llm"], nv.get("generator", 0),
                                           per_stage_trainable)
        self.num_virtual = nv
        self.stages: dict[StageId, Stage] = {}
        for sid in self.graph.stages:
            gd, tr, fr = built[sid]
            mesh = self.meshes[sid.unit][sid.index % plan.unit(sid.unit).pp]
            mode = self.graph.has_backward[sid]
            if mode == "full" and not self._needs_dx(sid):
                mode = "params"
            st = Stage(sid, mesh, plan.unit(sid.unit).dp, gd, shard_state(tr, mesh),
                       shard_state(fr, mesh), mode)
            st.fns = make_stage_fns(cfg, sid.unit, gd, mode, compute_dtype, with_gen, st.dp, mesh,
                                    plan.unit(sid.unit).overlap_tp)
            self.stages[sid] = st
        self.schedule = multimodal_one_f_one_b(self.graph, plan.num_microbatches)
        sim = simulate(self.schedule, lambda s, a: 1.0, self.graph)
        self.order = [(StageId.parse(t["stage"]), Action(t["kind"], t["microbatch"], t["chunk"]))
                      for t in sim.trace()]
        self.brokers: dict[tuple[StageId, StageId], Broker] = {}

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
        mesh = self.stages[sid].mesh
        return jax.tree.map(lambda a: jax.device_put(a, dp_sharding(mesh, np.ndim(a)))
                            if np.ndim(a) else jax.device_put(a, jax.sharding.NamedSharding(
                                mesh, jax.sharding.PartitionSpec())), tree)

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
    def run(self, feeds: list[MicrobatchFeed], trace: bool = False) -> StepResult:
        """Forward and backward of every microbatch; gradients accumulate in
        `stage.grads`. Returns device-side losses (no host sync unless `trace`)."""
        if len(feeds) != self.plan.num_microbatches:
            raise ValueError(f"got {len(feeds)} microbatch feeds; the plan has "
                             f"{self.plan.num_microbatches}")
        totals = (sum(f.num_target_tokens for f in feeds), sum(f.num_gen_elements for f in feeds))
        for st in self.stages.values():
            st.grads = jax.tree.map(jnp.zeros_like, st.trainable) if st.mode in ("full", "params") else None
        sides, inputs, outputs, cotangents = {}, {}, {}, {}
        result = StepResult()
        last_llm = StageId("llm", self.num_virtual["llm"] - 1)
        has_gen = self.cfg.generator is not None
        for sid, act in self.order:
            st, mb = self.stages[sid], act.microbatch
            t0 = time.perf_counter() if trace else 0.0
            if (sid, mb) not in sides:
                sides[(sid, mb)] = self._side(sid, feeds[mb], totals)
            side = sides[(sid, mb)]
            if act.kind == "F":
                x = self._gather_input(sid, mb, outputs, feeds[mb])
                y = st.fns.forward(st.trainable, st.frozen, x, side)
                inputs[(sid, mb)] = x
                if sid == last_llm:
                    lm, y = (y if has_gen else (y, None))
                    result.lm_loss.append(lm)
                elif sid.unit == "generator" and not self.graph.successors(sid):
                    result.diffusion_loss.append(y)
                    y = None
                outputs[(sid, mb)] = y
            else:
                dy = self._gather_cotangent(sid, mb, cotangents, feeds[mb])
                x = inputs.pop((sid, mb))
                grads, dx = st.fns.backward(st.trainable, st.frozen, x, side, dy,
                                            st.grads if st.grads is not None else {})
                if st.grads is not None:
                    st.grads = grads
                st.backward_calls += 1
                if dx is not None:
                    cotangents[(sid, mb)] = dx
            if trace:
                jax.block_until_ready((st.grads, outputs.get((sid, mb)), cotangents.get((sid, mb))))
                result.trace.append({"stage": str(sid), "kind": act.kind, "microbatch": mb,
                                     "chunk": act.chunk, "start": t0,
                                     "end": time.perf_counter()})
            if act.kind == "B" or not self.graph.runs_backward(sid):
                sides.pop((sid, mb), None)
        return result

    def _gather_input(self, sid, mb, outputs, feed):
        preds = self.graph.predecessors(sid)
        if not preds:
            return None
        if sid.unit == "llm" and sid.index == 0:
            return {p.unit: self._move(p, sid, outputs[(p, mb)], feed) for p in preds}
        (p,) = preds
        return self._move(p, sid, outputs[(p, mb)], feed)

    def _move(self, src, dst, x, feed, inverse=False):
        """Broker transfer src -> dst. Within a unit every dp rank's whole block is one part
        (viewed as [dp, block, ...] for the transfer); between units the feed's part maps."""
        pm = self._routes(src, dst, feed) if not inverse else self._routes(dst, src, feed).inverse()
        if src.unit != dst.unit:
            return self.broker(src, dst).transfer_tree(x, to_routes(pm))
        dp = self.stages[src].dp
        blocks = jax.tree.map(lambda a: a.reshape((dp, -1) + a.shape[1:]), x)
        moved = self.broker(src, dst).transfer_tree(blocks, to_routes(pm))
        return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), moved)

    def _gather_cotangent(self, sid, mb, cotangents, feed):
        succ = [s for s in self.graph.successors(sid) if self.graph.runs_backward(s)]
        moved = []
        for s in succ:
            dx = cotangents[(s, mb)]
            if s.unit == "llm" and s.index == 0 and sid.unit != "llm":
                dx = dx[sid.unit]
            moved.append(self._move(s, sid, dx, feed, inverse=True))
        one = jnp.ones((), jnp.float32)
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
