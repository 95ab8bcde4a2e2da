"""Communication broker: move dp-blocked tensors between disjoint sub-meshes (DistTrain §7).

A stage with DP size a sends to one with DP size b keeping sample order (or any part map:
OrchMLLM §6 rearrangement composition), by one `lax.all_to_all` inside `shard_map` over the
union of the two meshes' devices, so the same code works across processes. The route map is
a pair of device-input index tables, so the compiled program depends on shapes only and a
new assignment every step costs no compile. Every process holding devices of either mesh
calls `transfer` with the same arguments in the same order. Layout, tables and the XLA:CPU
caveat: docs/design.md "The broker".
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.data.routes import Routes

AXIS = "broker"  # the 1-D union mesh's axis
TABLES_KEPT = 64  # route maps whose device index tables a Broker keeps (oldest dropped first)


# ---- exchange tables (host, once per Routes) ------------------------------------------------
@dataclass(frozen=True)
class ExchangeTables:
    """Index tables of one all-to-all exchange over the union mesh (n devices, capacity C
    slots per sender -> receiver pair). `send[u, v * C + c]` is the source slot device u puts
    in its c-th place for device v (-1: nothing); `recv[v, q]` is where device v reads its
    destination slot q in the received `[n * C]` buffer, `u * C + c` (-1: zeros)."""

    capacity: int
    send: np.ndarray  # [n, n * capacity] int32
    recv: np.ndarray  # [n, dst_slots] int32
    count: np.ndarray | None = None  # [n, n] parts device u delivers to device v


def _bucket(k: int) -> int:
    """Capacity bucket: the next power of two >= max(k, 1), so route maps whose busiest pair
    differs a little share one compiled program."""
    return 1 << max(k - 1, 0).bit_length()


def deliveries(routes: Routes, src_replicas: list[list[int]],
               dst_replicas: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """(sender u, receiver v, src slot s, dst slot q) union-index deliveries. Every part goes
    to every replica of its destination rank; a receiver that is itself a replica of the
    source rank sends to itself, otherwise the source replica with the fewest deliveries to
    that receiver (then fewest in all) sends, which keeps the per-pair capacity low."""
    load = {d: 0 for reps in src_replicas for d in reps}
    pair: dict[tuple[int, int], int] = {}
    out = []
    for i, s, j, q in routes.pairs:
        reps = src_replicas[i]
        for v in dst_replicas[j]:
            u = v if v in reps else min(
                reps, key=lambda d: (pair.get((d, v), 0), load[d], reps.index(d)))
            load[u] += 1
            pair[(u, v)] = pair.get((u, v), 0) + 1
            out.append((u, v, s, q))
    return out


def exchange_tables(routes: Routes, src_replicas: list[list[int]],
                    dst_replicas: list[list[int]], n: int,
                    min_capacity: int = 1) -> ExchangeTables:
    """Plan one all-to-all: `src_replicas[i]` / `dst_replicas[j]` are the union indices of
    the devices holding dp rank i / j (their tp/cp replicas); `n` the union size. The
    capacity is the busiest pair's count rounded up to a power of two, at least
    `min_capacity` (a power of two)."""
    ds = deliveries(routes, src_replicas, dst_replicas)
    count = np.zeros((n, n), np.int64)
    for u, v, _, _ in ds:
        count[u, v] += 1
    cap = max(_bucket(int(count.max(initial=0))), min_capacity)
    send = np.full((n, n * cap), -1, np.int32)
    recv = np.full((n, routes.dst_slots), -1, np.int32)
    used = np.zeros((n, n), np.int64)
    for u, v, s, q in ds:
        c = used[u, v]
        used[u, v] += 1
        send[u, v * cap + c] = s
        recv[v, q] = u * cap + c
    return ExchangeTables(cap, send, recv, count)


def _exchange(x_tree, send, recv):
    """Per-device body inside shard_map: x leaves [src_slots, ...] -> [dst_slots, ...].
    Shapes alone fix the program: C and dst_slots come from the tables' shapes."""
    take, put_at = send[0], recv[0]

    def one(x):
        buf = jnp.take(x, jnp.maximum(take, 0), axis=0)             # [n * C, ...]
        got = lax.all_to_all(buf, AXIS, 0, 0, tiled=True)           # got[u*C+c] from u
        out = jnp.take(got, jnp.maximum(put_at, 0), axis=0)         # [dst_slots, ...]
        keep = (put_at >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, out, jnp.zeros((), x.dtype))
    return jax.tree.map(one, x_tree)


# ---- the broker -----------------------------------------------------------------------------
@dataclass
class _Tables:
    host: ExchangeTables
    send: jax.Array
    recv: jax.Array


def _device_array(devices) -> np.ndarray:
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr


class Broker:
    """Moves dp-blocked pytrees from `src_mesh` to `dst_mesh` (module docstring).

    Holds, per `Routes`, the exchange index tables on device (the last `TABLES_KEPT`); per
    slot counts, the largest capacity used so far; per shape key (leaf shapes/dtypes, union
    size, capacity bucket, slot counts), the compiled exchange, which no route map changes;
    and zero buffers for destination-only devices keyed by shape and dtype (buffers are
    immutable, so reusing them is safe)."""

    def __init__(self, src_mesh: Mesh, dst_mesh: Mesh):
        for name, m in (("src_mesh", src_mesh), ("dst_mesh", dst_mesh)):
            if "dp" not in m.axis_names:
                raise ValueError(f"Broker.{name} has axes {m.axis_names}; it needs a 'dp' axis")
        self.src_mesh, self.dst_mesh = src_mesh, dst_mesh
        self.src_sharding = NamedSharding(src_mesh, P("dp"))
        self.dst_sharding = NamedSharding(dst_mesh, P("dp"))
        self.a = src_mesh.shape["dp"]
        self.b = dst_mesh.shape["dp"]
        src_ranks = self._ranks(src_mesh)
        dst_ranks = self._ranks(dst_mesh)
        union = [d for reps in src_ranks for d in reps]
        seen = {d.id for d in union}
        union += [d for reps in dst_ranks for d in reps if d.id not in seen]
        self.union_devices = union
        self.union_mesh = Mesh(_device_array(union), (AXIS,), axis_types=(AxisType.Auto,))
        self.union_sharding = NamedSharding(self.union_mesh, P(AXIS))
        pos = {d.id: k for k, d in enumerate(union)}
        self.src_replicas = [[pos[d.id] for d in reps] for reps in src_ranks]
        self.dst_replicas = [[pos[d.id] for d in reps] for reps in dst_ranks]
        self.src_ids = {d.id for d in src_mesh.devices.flat}
        self.dst_devices = [d for reps in dst_ranks for d in reps]
        self.same_mesh = (src_mesh.devices.shape == dst_mesh.devices.shape and
                          all(s.id == d.id for s, d in
                              zip(src_mesh.devices.flat, dst_mesh.devices.flat)))
        self.tables: dict[Routes, _Tables] = {}
        self.programs: dict[tuple, object] = {}
        self.capacity: dict[tuple[int, int], int] = {}  # (src_slots, dst_slots) -> C so far
        self._fn = jax.jit(jax.shard_map(_exchange, mesh=self.union_mesh,
                                         in_specs=(P(AXIS),) * 3, out_specs=P(AXIS),
                                         check_vma=False))
        self.zeros: dict[tuple, jax.Array] = {}
        # set by the owner to count traffic (scripts/bench_runtime.py): (sender device id,
        # receiver device id) -> bytes of the parts delivered (a device's parts to itself
        # included); None: nothing counted, nothing spent
        self.ledger: dict[tuple[int, int], int] | None = None

    @staticmethod
    def _ranks(mesh: Mesh) -> list[list]:
        """Per dp rank, its devices (the replicas over the other axes), in mesh order."""
        devs = np.moveaxis(mesh.devices, mesh.axis_names.index("dp"), 0)
        return [list(devs[i].flat) for i in range(devs.shape[0])]

    # ---- host-side preparation ---------------------------------------------------------------
    def _tables(self, routes: Routes) -> _Tables:
        t = self.tables.get(routes)
        if t is not None and t.host.capacity >= self.capacity[(routes.src_slots,
                                                              routes.dst_slots)]:
            return t
        if routes.src_ranks != self.a or routes.dst_ranks != self.b:
            raise ValueError(f"Broker: routes map dp {routes.src_ranks} -> {routes.dst_ranks} "
                             f"but the meshes have dp {self.a} -> {self.b}; build the Routes "
                             f"for these meshes")
        # The capacity never shrinks for given slot counts, so a run compiles at most one
        # program per capacity doubling instead of flipping between buckets; all processes
        # make the same calls in the same order, so they agree on it.
        slots = (routes.src_slots, routes.dst_slots)
        host = exchange_tables(routes, self.src_replicas, self.dst_replicas,
                               len(self.union_devices), self.capacity.get(slots, 1))
        self.capacity[slots] = host.capacity
        send, recv = (jax.make_array_from_callback(a.shape, self.union_sharding,
                                                   lambda idx, a=a: a[idx], dtype=a.dtype)
                      for a in (host.send, host.recv))
        if len(self.tables) >= TABLES_KEPT:
            del self.tables[next(iter(self.tables))]
        t = self.tables[routes] = _Tables(host, send, recv)
        return t

    def _program(self, ins: list[jax.Array], t: _Tables):
        """The compiled exchange for these leaf shapes and table shapes (union size, capacity
        bucket, dst_slots): compiled once, whatever the route map."""
        key = (tuple((x.shape, x.dtype.str) for x in ins), t.send.shape, t.recv.shape)
        prog = self.programs.get(key)
        if prog is None:
            prog = self.programs[key] = self._fn.lower(ins, t.send, t.recv).compile()
        return prog

    def _zeros(self, shape, dtype, device) -> jax.Array:
        key = (tuple(shape), np.dtype(dtype).str, device.id)
        z = self.zeros.get(key)
        if z is None:
            z = self.zeros[key] = jnp.zeros(shape, dtype, device=device)
        return z

    # ---- wrapping ----------------------------------------------------------------------------
    def _to_union(self, x: jax.Array, src_slots: int) -> jax.Array:
        if x.ndim < 1 or x.shape[0] != self.a * src_slots:
            raise ValueError(f"Broker.transfer: leaf of shape {x.shape} must have axis 0 = "
                             f"src dp {self.a} * src_slots {src_slots} = {self.a * src_slots}")
        if not (isinstance(x, jax.Array) and x.sharding.is_equivalent_to(self.src_sharding,
                                                                          x.ndim)):
            x = jax.device_put(x, self.src_sharding)
        block = (src_slots,) + x.shape[1:]
        local = {s.device.id: s.data for s in x.addressable_shards}
        arrays = []
        for d in self.union_devices:
            if d.process_index != jax.process_index():
                continue
            arrays.append(local[d.id] if d.id in self.src_ids else self._zeros(block, x.dtype, d))
        shape = (len(self.union_devices) * src_slots,) + x.shape[1:]
        return jax.make_array_from_single_device_arrays(shape, self.union_sharding, arrays,
                                                       dtype=x.dtype)

    def _from_union(self, y: jax.Array, dst_slots: int) -> jax.Array:
        local = {s.device.id: s.data for s in y.addressable_shards}
        arrays = [local[d.id] for d in self.dst_devices if d.process_index == jax.process_index()]
        shape = (self.b * dst_slots,) + y.shape[1:]
        return jax.make_array_from_single_device_arrays(shape, self.dst_sharding, arrays,
                                                       dtype=y.dtype)

    # ---- public ------------------------------------------------------------------------------
    def transfer_tree(self, tree, routes: Routes, wait: bool = False):
        """Move every leaf of `tree` (dp-blocked, axis 0 = src dp * routes.src_slots; part
        shapes and dtypes may differ per leaf) by `routes`. No host sync, unless `wait`:
        then block until this process's part of the exchange is done (multi-process CPU
        runs, where two gloo collectives in flight can deadlock)."""
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            return tree
        if self.same_mesh and routes.is_identity:
            return jax.tree.unflatten(treedef, [
                x if isinstance(x, jax.Array) and x.sharding == self.dst_sharding
                else jax.device_put(x, self.dst_sharding) for x in leaves])
        t = self._tables(routes)
        if self.ledger is not None:
            self._count(t.host.count, leaves, routes.src_slots)
        ins = [self._to_union(x, routes.src_slots) for x in leaves]
        outs = self._program(ins, t)(ins, t.send, t.recv)
        if wait:
            jax.block_until_ready(outs)
        return jax.tree.unflatten(treedef, [self._from_union(y, routes.dst_slots) for y in outs])

    def _count(self, count: np.ndarray, leaves, src_slots: int) -> None:
        """Add one exchange's delivered bytes per device pair to `ledger` (shapes only)."""
        part = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize for x in leaves)
        for u, v in zip(*np.nonzero(count)):
            key = (self.union_devices[u].id, self.union_devices[v].id)
            self.ledger[key] = self.ledger.get(key, 0) + int(count[u, v]) * part

    def transfer(self, x: jax.Array, routes: Routes, wait: bool = False) -> jax.Array:
        """Move one dp-blocked array by `routes` (see `transfer_tree`)."""
        return self.transfer_tree([x], routes, wait=wait)[0]
