"""One differentiable all-to-all that moves a phase's rows to another phase's layout on one
mesh (OrchMLLM §6, rearrangement composition: encoder outputs straight to the LLM's ranks).

In the co-located layout every unit runs on all devices of one mesh, each with its own
data-parallel layout (which samples each rank holds, chosen by its post-balancing policy,
OrchMLLM §5). Encoder E's outputs, `[a * S, ...]` blocked over the encoder's dp axes (S rows
per rank), must reach the LLM's layout, `[b * D, ...]` blocked over the LLM's dp axes. A
`Routes` (data/routes.py) names, for every LLM (rank, row), the encoder (rank, row) that fills
it. `exchange` applies it as one `lax.all_to_all` over all the mesh's devices inside
`shard_map`, with a static per-pair capacity C: device u gathers the rows it sends to device v
into its v-th block of C slots; after the all-to-all device v picks its rows out of the
received `[n * C]` buffer. The route map lives in two int32 index tables (device inputs), so a
new map every step compiles nothing. Its VJP is the same exchange with the inverse map's
tables: gradients go back to the encoder ranks by one all-to-all, no scatter-add.

Replicas: a rank spread over several devices (the LLM at dp 4 x tp 2 on 8 devices) receives
its rows on every replica; one replica of a source rank sends each row (the one with the
fewest deliveries to that receiver, as `deliveries.deliveries_array` picks).

`TrafficLedger` counts the bytes an exchange really delivers per link class ("local": a
device to itself, "intra_node", "inter_node"), from the send counts of its tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.data.routes import Routes
from mmjax.parallel.deliveries import deliveries_array, pair_counts
from mmjax.parallel.exchange_stages import Caps, Topology, caps_bytes, needed_caps
from mmjax.parallel.exchange_tables import StagedTables, staged_tables
from mmjax.parallel.ragged_exchange import ragged_body
from mmjax.parallel.ragged_tables import RaggedCaps, RaggedTables, ragged_caps, ragged_tables


def _axes(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def rank_devices(mesh: Mesh, dp_axes) -> list[list[int]]:
    """Per dp rank (row-major over `dp_axes`), the flat positions (row-major over all of
    `mesh.axis_names`, the all-to-all's device index) of the devices holding it."""
    dp_axes = _axes(dp_axes)
    for a in dp_axes:
        if a not in mesh.axis_names:
            raise ValueError(f"rearrange: dp axis {a!r} is not an axis of the mesh "
                             f"{mesh.axis_names}")
    names = list(mesh.axis_names)
    pos = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    rest = [a for a in names if a not in dp_axes]
    pos = np.transpose(pos, [names.index(a) for a in dp_axes] + [names.index(a) for a in rest])
    ranks = int(np.prod([mesh.shape[a] for a in dp_axes], dtype=np.int64))
    return [sorted(p.ravel().tolist()) for p in pos.reshape(ranks, -1)]


@dataclass(frozen=True)
class ExchangePlan:
    """Host-side plan of one rearrangement and its inverse on `num_devices` devices, as
    staged exchanges (parallel/exchange_stages.py) over nodes of `ranks_per_node`, or
    ragged ones (parallel/ragged_tables.py, GPU)."""

    routes: Routes
    forward: StagedTables | RaggedTables
    backward: StagedTables | RaggedTables
    num_devices: int

    @property
    def capacity(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(forward, backward) rows per shift: the compiled shapes."""
        return self.forward.caps, self.backward.caps


def _topology(mesh: Mesh, ranks_per_node: int | None) -> Topology:
    n = mesh.devices.size
    return Topology(n, ranks_per_node or n)


def _deliveries(routes: Routes, mesh: Mesh, src_axes, dst_axes):
    src = rank_devices(mesh, src_axes)
    dst = rank_devices(mesh, dst_axes)
    if routes.src_ranks != len(src) or routes.dst_ranks != len(dst):
        raise ValueError(f"rearrange: routes map dp {routes.src_ranks} -> {routes.dst_ranks} "
                         f"but the mesh's axes {_axes(src_axes)} -> {_axes(dst_axes)} give dp "
                         f"{len(src)} -> {len(dst)}")
    return deliveries_array(routes, src, dst), deliveries_array(routes.inverse(), dst, src)


def exchange_caps(routes: Routes, mesh: Mesh, src_axes, dst_axes,
                  ranks_per_node: int | None = None, kind: str = "staged"
                  ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward, backward) least bucketed rows per shift (`kind` "staged"), or (send,
    receive) buffer rows ("ragged"), that carry `routes` and its inverse (host side; the
    runner's shape scan joins them over a run's batches, `join_caps`, so the compiled
    shapes never change after warm-up)."""
    topo = _topology(mesh, ranks_per_node)
    fwd, bwd = _deliveries(routes, mesh, src_axes, dst_axes)
    if kind == "ragged":
        return ragged_caps(pair_counts(fwd, topo.n)), ragged_caps(pair_counts(bwd, topo.n))
    return (needed_caps(pair_counts(fwd, topo.n), topo),
            needed_caps(pair_counts(bwd, topo.n), topo))


def plan_exchange(routes: Routes, mesh: Mesh, src_axes, dst_axes,
                  capacity: tuple[Caps, Caps] | None = None,
                  ranks_per_node: int | None = None, kind: str = "staged") -> ExchangePlan:
    """Index tables moving `routes` from the `src_axes` layout to the `dst_axes` layout of
    `mesh`, and back, by staged exchanges over nodes of `ranks_per_node` devices (None: one
    node). `capacity`: (forward, backward) static rows per shift (the compiled program
    depends on them; keep them fixed across steps, e.g. the run's scanned `exchange_caps`
    joined); None: this map's own, bucketed. `kind` "ragged": one ragged all-to-all each
    way instead (GPU; `capacity` its (send, receive) buffer rows)."""
    topo = _topology(mesh, ranks_per_node)
    fwd, bwd = _deliveries(routes, mesh, src_axes, dst_axes)
    fc, bc = (None, None) if capacity is None else capacity
    if kind == "ragged":
        s, d = routes.src_slots, routes.dst_slots
        # kind 'ragged': the capacities are RaggedCaps (send rows, receive rows)
        return ExchangePlan(routes, ragged_tables(fwd, topo.n, s, d, cast(RaggedCaps, fc)),
                            ragged_tables(bwd, topo.n, d, s, cast(RaggedCaps, bc)), topo.n)
    return ExchangePlan(routes,
                        staged_tables(fwd, topo, routes.src_slots, routes.dst_slots, fc),
                        staged_tables(bwd, topo, routes.dst_slots, routes.src_slots, bc),
                        topo.n)


def _host_tables(t: StagedTables | RaggedTables) -> dict:
    if isinstance(t, RaggedTables):
        return t.device_arrays()
    stages: dict[str, list] = {"A": [], "B": [], "C": []}
    for (stage, _), send in zip(t.topo.shifts(), t.send):
        stages[stage].append(send)
    return {**{k: tuple(v) for k, v in stages.items()}, "recv": t.recv}


def device_tables(plan: ExchangePlan, mesh: Mesh) -> dict:
    """{"fwd", "bwd"}: each direction's tables on `mesh`, one row per device ({"A", "B",
    "C"}: per stage, per shift, the [n, capacity] send tables; "recv"), so the compiled
    shapes carry the capacities. Each process places its own devices' rows: every process
    plans the same tables."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    put = lambda t: jax.make_array_from_callback(t.shape, sharding, lambda idx: t[idx])
    return {"fwd": jax.tree.map(put, _host_tables(plan.forward)),
            "bwd": jax.tree.map(put, _host_tables(plan.backward))}


def _body(x, tables, *, axes, n):
    """Per device: x [src rows, ...] -> [dst rows, ...] by the staged exchange's collective
    permutes (exchange_stages.py): stages A and C gather their shifts' buffers from the pool,
    permute them and append what arrives; stage B's hops run one after another, each
    appending before the next (a row may take several hops); the output is gathered from the
    final pool."""
    topo = Topology(n, len(tables["A"]) + 1)
    shifts = {st: [k for s, k in topo.shifts() if s == st] for st in ("A", "B", "C")}
    pool = x
    for stage in ("A", "B", "C"):
        got = []
        for shift, send in zip(shifts[stage], tables[stage]):
            take = send[0]
            if take.shape[0] == 0:
                continue
            buf = jnp.take(pool, jnp.maximum(take, 0), axis=0)
            got.append(lax.ppermute(buf, axes, topo.perm(stage, shift)))
            if stage == "B":
                pool, got = jnp.concatenate([pool] + got, axis=0), []
        if got:
            pool = jnp.concatenate([pool] + got, axis=0)
    put = tables["recv"][0]
    out = jnp.take(pool, jnp.maximum(put, 0), axis=0)            # [dst rows, ...]
    keep = (put >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, out, jnp.zeros((), x.dtype))


FORWARD_SCOPE, BACKWARD_SCOPE = "rearrange_fwd", "rearrange_bwd"  # the HLO ops' op_name


def _move(x, tables, mesh, src_axes, dst_axes, scope):
    every = tuple(mesh.axis_names)
    spec = jax.tree.map(lambda _: P(every), tables)
    body = (partial(ragged_body, axes=every, scope=scope) if "take" in tables
            else partial(_body, axes=every, n=mesh.size))
    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(P(src_axes), spec), out_specs=P(dst_axes), check_vma=False)
    with jax.named_scope(scope):
        return fn(x, tables)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _exchange(x, tables, mesh, src_axes, dst_axes):
    return _move(x, tables["fwd"], mesh, src_axes, dst_axes, FORWARD_SCOPE)


def _exchange_fwd(x, tables, mesh, src_axes, dst_axes):
    return _move(x, tables["fwd"], mesh, src_axes, dst_axes, FORWARD_SCOPE), tables


def _exchange_bwd(mesh, src_axes, dst_axes, tables, g):
    dx = _move(g, tables["bwd"], mesh, dst_axes, src_axes, BACKWARD_SCOPE)
    return dx, jax.tree.map(lambda t: np.zeros(t.shape, jax.dtypes.float0), tables)


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(x: jax.Array, tables, mesh: Mesh, src_axes, dst_axes) -> jax.Array:
    """Move `x` ([src dp * S, ...], blocked over `src_axes`) to `[dst dp * D, ...]` blocked
    over `dst_axes` by the plan whose `device_tables` are `tables`; rows nobody fills are
    zeros. Differentiable: the VJP is the inverse exchange. Works under jit (tables may be
    traced arguments) and on any dtype."""
    if x.ndim < 1:
        raise ValueError(f"rearrange.exchange: x needs a leading row axis, got shape {x.shape}")
    return _exchange(x, tables, mesh, _axes(src_axes), _axes(dst_axes))


def route_tables(routes: dict, mesh: Mesh, src_axes, dst_axes,
                 capacity: tuple[Caps, Caps] | None = None,
                 ledger: "TrafficLedger | None" = None, row_bytes: dict | None = None,
                 ranks_per_node: int | None = None, kind: str = "staged"
                 ) -> dict[str, dict]:
    """Per encoder, its exchange's `device_tables` (for the step's inputs, `ROUTE_KEY`),
    staged over nodes of `ranks_per_node` (None: the ledger's, else one node). With a
    `ledger`, each exchange's forward and backward are counted there at `row_bytes[e]`
    bytes per row (the encoder output's width x dtype bytes)."""
    if ranks_per_node is None and ledger is not None:
        ranks_per_node = ledger.ranks_per_node
    out = {}
    for e, r in routes.items():
        plan = plan_exchange(r, mesh, src_axes, dst_axes, capacity, ranks_per_node, kind)
        if ledger is not None:
            if row_bytes is None or e not in row_bytes:
                raise ValueError(f"route_tables: a ledger needs row_bytes[{e!r}]")
            ledger.add(plan.forward, row_bytes[e])
            ledger.add(plan.backward, row_bytes[e])
        out[e] = device_tables(plan, mesh)
    return out


ROUTE_KEY = "route"  # the step inputs' entry holding route_tables


def phase_route(mesh: Mesh, src_axes, dst_axes):
    """The co-located runner's seam (`MultimodalModel.__call__`'s `route`): every encoder's
    outputs, blocked over `src_axes` in its phase's layout, to the LLM's layout over
    `dst_axes`, by the tables in `batch[ROUTE_KEY]` (one all-to-all each, inverse in the
    backward). A batch without tables is already in one layout: returned as is."""
    def route(enc_outputs: dict, batch) -> dict:
        tables = batch.get(ROUTE_KEY) if hasattr(batch, "get") else None
        if tables is None:
            return enc_outputs
        return {e: exchange(x, tables[e], mesh, src_axes, dst_axes)
                for e, x in enc_outputs.items()}
    return route


@dataclass
class TrafficLedger:
    """Bytes of the encoder->LLM exchanges per link class; device position p (row-major over
    the mesh) is on node p // ranks_per_node. `payload`: the rows the tables deliver
    ("local": a device to itself, no link; "intra_node"; "inter_node"); `sent`: what the
    staged exchange's collective permutes move at their static capacities, padding
    included (`exchange_stages.caps_bytes`: equal to the compiled program's collective
    operands, `hlo_traffic`); a ragged exchange sends its real rows (its send sizes, within
    the compiled buffers, `hlo_traffic.ragged_operands`)."""

    ranks_per_node: int
    payload: dict[str, int] = field(default_factory=lambda: {
        "local": 0, "intra_node": 0, "inter_node": 0})
    sent: dict[str, int] = field(default_factory=lambda: {"intra_node": 0, "inter_node": 0})

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ValueError(f"TrafficLedger.ranks_per_node={self.ranks_per_node}: use >= 1")

    def add(self, tables: StagedTables | RaggedTables, row_bytes: int) -> None:
        """Count one exchange by `tables` of rows of `row_bytes` bytes each."""
        count = tables.count
        n = count.shape[0]
        if n % self.ranks_per_node:
            raise ValueError(f"TrafficLedger: {n} devices are not whole nodes of "
                             f"{self.ranks_per_node}")
        node = np.arange(n) // self.ranks_per_node
        same = node[:, None] == node[None, :]
        eye = np.eye(n, dtype=bool)
        self.payload["local"] += int(count[eye].sum()) * row_bytes
        self.payload["intra_node"] += int(count[same & ~eye].sum()) * row_bytes
        self.payload["inter_node"] += int(count[~same].sum()) * row_bytes
        if isinstance(tables, RaggedTables):  # a link carries its real rows, no padding
            self.sent["intra_node"] += int(count[same & ~eye].sum()) * row_bytes
            self.sent["inter_node"] += int(count[~same].sum()) * row_bytes
            return
        for k, v in caps_bytes(tables.caps, tables.topo, row_bytes,
                               self.ranks_per_node).items():
            self.sent[k] += v
