"""What moves between pipeline stages, and onto them: per microbatch the host inputs a stage
reads (its side of the feed, placed on its mesh), the activations a stage takes from its
predecessors and the cotangents it takes from its successors, each moved by the broker of
the (source, destination) pair (parallel/broker.py) along the feed's routes (within a unit
every dp rank's whole block; between units the parts of data/feed.py).

Multi-process: a process with devices on neither side of a transfer keeps only shapes; one
with none on the source side sends no-shard placeholders (pipeline/multiprocess.py).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from mmjax.data.feed import MicrobatchFeed
from mmjax.data.routes import Routes
from mmjax.models.units import is_generator, is_llm, is_vae
from mmjax.parallel.broker import Broker
from mmjax.pipeline.lora_dropout import SIDE_KEY, dropout_ids
from mmjax.pipeline.multiprocess import abstract, global_put, placeholders
from mmjax.pipeline.stage import dp_sharding
from mmjax.schedule.stage_graph import StageGraph, StageId


class Transfers:
    """The stage-to-stage moves of one runtime: `stages` {StageId: Stage}, `graph` their
    StageGraph, `num_llm` the LLM's virtual stages, `has_generator` whether the model has
    one, `sync` wait for each transfer (multi-process CPU). Brokers are made on first use
    and kept (`brokers`, their ledgers count the traffic)."""

    def __init__(self, stages: dict, graph: StageGraph, num_llm: int, has_generator: bool,
                 sync: bool, dropout_units: frozenset = frozenset(), exchange: str = "staged"):
        self.stages, self.graph, self.num_llm = stages, graph, num_llm
        self.has_generator, self.sync = has_generator, sync
        self.dropout_units = dropout_units  # units whose stages apply LoRA dropout
        self.brokers: dict[tuple[StageId, StageId], Broker] = {}
        self.exchange = exchange  # the brokers' form: "staged" or "ragged" (GPU)
        self._ones: dict[StageId, jax.Array] = {}  # per last stage, its loss cotangent

    def broker(self, src: StageId, dst: StageId) -> Broker:
        key = (src, dst)
        if key not in self.brokers:
            self.brokers[key] = Broker(self.stages[src].mesh, self.stages[dst].mesh,
                                       self.exchange)
        return self.brokers[key]

    def routes(self, src: StageId, dst: StageId, feed: MicrobatchFeed) -> Routes:
        if src.unit == dst.unit:
            return Routes.identity(self.stages[src].dp)
        if is_vae(src.unit):  # the generator's rows in order: dp_vae blocks -> dp_gen blocks
            return Routes.order_preserving(self.stages[src].dp, self.stages[dst].dp)
        if is_llm(dst.unit):
            return feed.enc_routes[src.unit]
        assert feed.gen_routes is not None  # a stage feeds the generator: the feed has its rows
        return feed.gen_routes

    # ---- host inputs ----------------------------------------------------------------
    def put(self, sid: StageId, tree):
        """Host arrays onto stage `sid`'s mesh, split over dp on their leading axis
        (scalars replicated); shapes only for a stage of another process."""
        st = self.stages[sid]
        if not st.local:
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype),
                                tree)
        mesh = st.mesh
        return global_put(tree, jax.tree.map(
            lambda a: dp_sharding(mesh, np.ndim(a)) if np.ndim(a) else
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), tree),
            batched=True)

    def side(self, sid: StageId, feed: MicrobatchFeed, totals,
             dropout: tuple[int, int] | None = None):
        """The part of `feed` stage `sid` reads, placed; `totals` = (the step's trained
        tokens, generated elements): the loss normalisers; `dropout` = (applied-step count,
        microbatch) in a training step: a LoRA-dropout unit's stage also gets its mask ids
        (pipeline/lora_dropout.py)."""
        side = self._side(sid, feed, totals)
        if dropout is not None and sid.unit in self.dropout_units:
            ids = dropout_ids(sid.unit, sid.index, *dropout, self.stages[sid].dp)
            side = {**side, SIDE_KEY: self.put(sid, ids)}
        return side

    def _side(self, sid: StageId, feed: MicrobatchFeed, totals):
        u = sid.unit
        if is_llm(u):
            side = {"llm": feed.llm, "num_tokens": np.float32(max(totals[0], 1))}
            if self.has_generator:
                side["gen_pack"] = feed.gen_pack
            return self.put(sid, side)
        if is_generator(u):  # the pixels go to the VAE unit only
            gen = {k: v for k, v in feed.gen.items() if k != "gen_pixels"}
            return self.put(sid, {"gen": gen, "num_gen": np.float32(max(totals[1], 1))})
        if is_vae(u):
            return self.put(sid, {"pixels": feed.gen["gen_pixels"]})
        return self.put(sid, {"inputs": feed.enc_inputs[u], "pack": feed.enc_pack[u]})

    # ---- activations and cotangents -------------------------------------------------
    def gather_input(self, sid, mb, outputs, feed):
        """Stage `sid`'s input for microbatch `mb`: its predecessors' outputs moved to it
        (the first LLM stage: {encoder: its projected outputs}); None for a first stage."""
        preds = self.graph.predecessors(sid)
        if not preds:
            return None
        if len(preds) > 1 or (is_llm(sid.unit) and sid.index == 0):
            return {p.unit: self.move(p, sid, outputs[(p, mb)], feed) for p in preds}
        (p,) = preds
        return self.move(p, sid, outputs[(p, mb)], feed)

    def gather_cotangent(self, sid, mb, cotangents, feed):
        """Stage `sid`'s output cotangent for microbatch `mb`: its successors' input
        cotangents moved back to it, or the loss cotangent at a last stage (the last LLM
        stage with a generator: both)."""
        succ = [s for s in self.graph.successors(sid) if self.graph.runs_backward(s)]
        moved = []
        for s in succ:
            dx = cotangents[(s, mb)]
            if isinstance(dx, dict):  # a stage with several inputs: the one from `sid`
                dx = dx[sid.unit]
            moved.append(self.move(s, sid, dx, feed, inverse=True))
        one = self.one(sid)
        if is_llm(sid.unit) and not self.graph.successors(sid):
            return one
        if is_llm(sid.unit) and sid.index == self.num_llm - 1:
            (dcond,) = moved if moved else (None,)
            if dcond is None:
                raise RuntimeError("internal: the last LLM stage runs backward but the "
                                   "generator does not; the frozen rule makes this impossible")
            return (one, dcond)
        if is_generator(sid.unit) and not self.graph.successors(sid):
            return one
        (d,) = moved
        return d

    def move(self, src, dst, x, feed, inverse=False):
        """Broker transfer src -> dst. Within a unit every dp rank's whole block is one part
        (viewed as [dp, block, ...] for the transfer); between units the feed's routes.
        A process with devices on neither side skips it (shapes only); one with none on the
        source side sends no-shard placeholders, one with none on the destination side
        keeps the result's shapes."""
        routes = (self.routes(src, dst, feed) if not inverse
                  else self.routes(dst, src, feed).inverse())
        src_local, dst_local = self.stages[src].local, self.stages[dst].local
        if is_vae(src.unit):  # rows [R, ...] as routes.src_ranks * src_slots parts in order
            parts = routes.src_ranks * routes.src_slots
            x = jax.tree.map(lambda a: _reshaped(a, (parts, -1), src_local), x)
            moved = self._move_parts(src, dst, x, routes, src_local, dst_local)
            return jax.tree.map(lambda a: _reshaped(a, (-1,), dst_local), moved)
        intra = src.unit == dst.unit
        if not (src_local or dst_local):
            if intra:
                return abstract(x)
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                (routes.dst_ranks * routes.dst_slots,) + tuple(a.shape[1:]), a.dtype), x)
        dp = self.stages[src].dp
        broker = self.broker(src, dst)
        if intra:
            x = (dp_blocks(x, dp) if src_local else jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((dp, a.shape[0] // dp) + tuple(a.shape[1:]),
                                               a.dtype), x))
        if not src_local:
            x = placeholders(x, broker.src_sharding)
        moved = broker.transfer_tree(x, routes, wait=self.sync)
        if not dst_local:
            moved = abstract(moved)
        if not intra:
            return moved
        if dst_local:
            return merged_blocks(moved)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
            (a.shape[0] * a.shape[1],) + tuple(a.shape[2:]), a.dtype), moved)

    def _move_parts(self, src, dst, x, routes, src_local, dst_local):
        """`x` as parts [ranks * slots, ...] moved by `routes` (the broker's transfer), with
        the placeholders of a process that lacks one side."""
        if not (src_local or dst_local):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(
                (routes.dst_ranks * routes.dst_slots,) + tuple(a.shape[1:]), a.dtype), x)
        broker = self.broker(src, dst)
        if not src_local:
            x = placeholders(x, broker.src_sharding)
        moved = broker.transfer_tree(x, routes, wait=self.sync)
        return moved if dst_local else abstract(moved)

    def one(self, sid):
        """The loss cotangent 1.0 per dp rank, `[dp]` on the stage mesh's dp axis (placed
        once: no program donates it)."""
        one = self._ones.get(sid)
        if one is None:
            st = self.stages[sid]
            one = self._ones[sid] = global_put(np.ones((st.dp,), np.float32),
                                               dp_sharding(st.mesh, 1))
        return one


@functools.partial(jax.jit, static_argnums=1)
def dp_blocks(tree, dp: int):
    """Rows [dp * b, ...] -> [dp, b, ...] for every leaf: one program per move (not one
    eager reshape per leaf)."""
    return jax.tree.map(lambda a: a.reshape((dp, -1) + a.shape[1:]), tree)


@jax.jit
def merged_blocks(tree):
    """[dp, b, ...] -> rows [dp * b, ...] for every leaf (`dp_blocks`' inverse)."""
    return jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]), tree)


def _reshaped(a, lead: tuple, local: bool):
    """`a` with its leading axis reshaped to `lead` (-1 for the rest of it), or its shape
    alone for an array of another process."""
    rows = a.shape[0] * (a.shape[1] if len(lead) == 1 else 1)
    rest = a.shape[2:] if len(lead) == 1 else a.shape[1:]
    shape = (rows,) if len(lead) == 1 else (lead[0], rows // lead[0])
    if local:
        return a.reshape(shape + tuple(rest))
    return jax.ShapeDtypeStruct(shape + tuple(rest), a.dtype)
