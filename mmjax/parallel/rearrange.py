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
fewest deliveries to that receiver, as `broker.deliveries` picks).

`TrafficLedger` counts the bytes an exchange really delivers per link class ("local": a
device to itself, "intra_node", "inter_node"), from the send counts of its tables.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.data.routes import Routes
from mmjax.parallel.broker import ExchangeTables, deliveries


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
    """Host-side plan of one rearrangement and its inverse on `num_devices` devices (the
    forward's and backward's index tables share the static capacity C)."""

    routes: Routes
    forward: ExchangeTables
    backward: ExchangeTables
    num_devices: int

    @property
    def capacity(self) -> int:
        return self.forward.capacity


def busiest_pair(routes: Routes, mesh: Mesh, src_axes, dst_axes) -> int:
    """Rows the busiest device pair sends in the exchange or its inverse: the least static
    capacity `plan_exchange` takes for `routes` (host side; the runner's shape scan keeps
    the maximum over a run's batches, so the tables' shapes never change)."""
    src, dst = rank_devices(mesh, src_axes), rank_devices(mesh, dst_axes)
    n = mesh.devices.size
    return max(_busiest(deliveries(routes, src, dst), n),
               _busiest(deliveries(routes.inverse(), dst, src), n))


def plan_exchange(routes: Routes, mesh: Mesh, src_axes, dst_axes,
                  capacity: int | None = None) -> ExchangePlan:
    """Index tables moving `routes` from the `src_axes` layout to the `dst_axes` layout of
    `mesh`, and back. `capacity`: the static rows per device pair (the compiled program
    depends on it; keep it fixed across steps, e.g. the step's global row floor); None: the
    busiest pair's count, rounded up to a power of two."""
    src = rank_devices(mesh, src_axes)
    dst = rank_devices(mesh, dst_axes)
    if routes.src_ranks != len(src) or routes.dst_ranks != len(dst):
        raise ValueError(f"rearrange: routes map dp {routes.src_ranks} -> {routes.dst_ranks} "
                         f"but the mesh's axes {_axes(src_axes)} -> {_axes(dst_axes)} give dp "
                         f"{len(src)} -> {len(dst)}")
    n = mesh.devices.size
    inverse = routes.inverse()
    fwd = deliveries(routes, src, dst)
    bwd = deliveries(inverse, dst, src)
    busiest = max(_busiest(fwd, n), _busiest(bwd, n))
    if capacity is None:
        capacity = 1 << max(busiest - 1, 0).bit_length()
    elif busiest > capacity:
        raise ValueError(f"rearrange: capacity={capacity} rows per device pair is below the "
                         f"busiest pair's {busiest} (raise the capacity)")
    fwd = _tables(fwd, n, capacity, routes.dst_slots)
    bwd = _tables(bwd, n, capacity, routes.src_slots)
    return ExchangePlan(routes, fwd, bwd, n)


def _busiest(ds, n: int) -> int:
    count = np.zeros((n, n), np.int64)
    for u, v, _, _ in ds:
        count[u, v] += 1
    return int(count.max(initial=0))


def _tables(ds, n: int, capacity: int, dst_slots: int) -> ExchangeTables:
    """`broker.exchange_tables` at exactly `capacity` slots per pair (no power-of-two
    rounding: the caller fixes it so the program stays the same across steps)."""
    send = np.full((n, n * capacity), -1, np.int32)
    recv = np.full((n, dst_slots), -1, np.int32)
    count = np.zeros((n, n), np.int64)
    for u, v, s, q in ds:
        c = count[u, v]
        count[u, v] += 1
        send[u, v * capacity + c] = s
        recv[v, q] = u * capacity + c
    return ExchangeTables(capacity, send, recv, count)


def device_tables(plan: ExchangePlan, mesh: Mesh) -> tuple[jax.Array, ...]:
    """(send, recv, send_back, recv_back): the plan's tables on `mesh`, one row per device
    (each process places its own devices' rows: every process plans the same tables)."""
    sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return tuple(jax.make_array_from_callback(t.shape, sharding, lambda idx, t=t: t[idx])
                 for t in (plan.forward.send, plan.forward.recv, plan.backward.send,
                           plan.backward.recv))


def _body(x, send, recv, *, axes):
    """Per device: x [src rows, ...] -> [dst rows, ...] by one all-to-all (C from send)."""
    take, put = send[0], recv[0]
    buf = jnp.take(x, jnp.maximum(take, 0), axis=0)            # [n * C, ...]
    got = lax.all_to_all(buf, axes, 0, 0, tiled=True)          # got[u * C + c] from u
    out = jnp.take(got, jnp.maximum(put, 0), axis=0)           # [dst rows, ...]
    keep = (put >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, out, jnp.zeros((), x.dtype))


def _move(x, send, recv, mesh, src_axes, dst_axes):
    every = tuple(mesh.axis_names)
    fn = jax.shard_map(partial(_body, axes=every), mesh=mesh,
                       in_specs=(P(src_axes), P(every), P(every)), out_specs=P(dst_axes),
                       check_vma=False)
    return fn(x, send, recv)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _exchange(x, send, recv, send_back, recv_back, mesh, src_axes, dst_axes):
    return _move(x, send, recv, mesh, src_axes, dst_axes)


def _exchange_fwd(x, send, recv, send_back, recv_back, mesh, src_axes, dst_axes):
    return _move(x, send, recv, mesh, src_axes, dst_axes), (send, recv, send_back, recv_back)


def _exchange_bwd(mesh, src_axes, dst_axes, res, g):
    send, recv, send_back, recv_back = res
    dx = _move(g, send_back, recv_back, mesh, dst_axes, src_axes)
    return dx, None, None, None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def exchange(x: jax.Array, tables, mesh: Mesh, src_axes, dst_axes) -> jax.Array:
    """Move `x` ([src dp * S, ...], blocked over `src_axes`) to `[dst dp * D, ...]` blocked
    over `dst_axes` by the plan whose `device_tables` are `tables`; rows nobody fills are
    zeros. Differentiable: the VJP is the inverse exchange. Works under jit (tables may be
    traced arguments) and on any dtype."""
    if x.ndim < 1:
        raise ValueError(f"rearrange.exchange: x needs a leading row axis, got shape {x.shape}")
    send, recv, send_back, recv_back = tables
    return _exchange(x, send, recv, send_back, recv_back, mesh, _axes(src_axes), _axes(dst_axes))


def exchange_tree(tree, tables, mesh: Mesh, src_axes, dst_axes):
    """`exchange` on every leaf of a pytree (same route map, per-leaf row shapes)."""
    return jax.tree.map(lambda x: exchange(x, tables, mesh, src_axes, dst_axes), tree)


def route_tables(routes: dict, mesh: Mesh, src_axes, dst_axes,
                 capacity: int | None = None, ledger: "TrafficLedger | None" = None,
                 row_bytes: dict | None = None) -> dict[str, tuple[jax.Array, ...]]:
    """Per encoder, its exchange's `device_tables` (for the step's inputs, `ROUTE_KEY`).
    With a `ledger`, each exchange's forward and backward deliveries are counted there at
    `row_bytes[e]` bytes per row (the encoder output's width x dtype bytes)."""
    out = {}
    for e, r in routes.items():
        plan = plan_exchange(r, mesh, src_axes, dst_axes, capacity)
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
    """Bytes an exchange delivers, per link class: "local" (a device to itself, no link),
    "intra_node", "inter_node"; device position p (row-major over the mesh) is on node
    p // ranks_per_node. `payload` counts the rows really sent (the tables' send counts);
    `wire` what the static-capacity all-to-all moves between distinct devices (C rows per
    pair, padding included)."""

    ranks_per_node: int
    payload: dict[str, int] = field(default_factory=lambda: {
        "local": 0, "intra_node": 0, "inter_node": 0})
    wire: dict[str, int] = field(default_factory=lambda: {"intra_node": 0, "inter_node": 0})

    def __post_init__(self):
        if self.ranks_per_node < 1:
            raise ValueError(f"TrafficLedger.ranks_per_node={self.ranks_per_node}: use >= 1")

    def add(self, tables: ExchangeTables, row_bytes: int) -> None:
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
        cap = tables.capacity * row_bytes
        self.wire["intra_node"] += int((same & ~eye).sum()) * cap
        self.wire["inter_node"] += int((~same).sum()) * cap
