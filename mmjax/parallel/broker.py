"""Communication broker: move dp-blocked tensors between disjoint sub-meshes (DistTrain §7).

A stage with DP size a sends to one with DP size b keeping sample order (or any part map:
OrchMLLM §6 rearrangement composition) by rounds of collective permutes over DistTrain's
gcd(a, b) groups (`broker_rounds.py`), inside `shard_map` over the union of the two meshes'
devices, so the same code works across processes. Each device sends the rows its pairs
really exchange (each round sized to its busiest pair, bucketed), not `n * C` rows of a
union-wide all-to-all. The route map is a pair of device-input index tables, and the rounds
depend on the meshes only, so the compiled program depends on shapes and round sizes alone
and a new assignment every step costs no compile. Every process holding devices of either
mesh calls `transfer` with the same arguments in the same order. Layout, tables and the
XLA:CPU caveat: docs/design.md "The broker". `exchange="ragged"` (GPU): one
`lax.ragged_all_to_all` over the union instead of the rounds, each link carrying its real
rows (parallel/ragged_tables.py).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.data.routes import Routes
from mmjax.parallel.broker_rounds import (RoundTables, device_rounds, needed_caps,
                                          ordered_round_count, permutes, round_tables)
from mmjax.parallel.deliveries import deliveries_array, pair_counts
from mmjax.parallel.ragged_exchange import ragged_body
from mmjax.parallel.ragged_tables import RaggedTables, ragged_caps, ragged_tables

AXIS = "broker"  # the 1-D union mesh's axis
TABLES_KEPT = 64  # route maps whose device index tables a Broker keeps (oldest dropped first)


def _exchange(x_tree, tables, permutes):
    """Per-device body inside shard_map: x leaves [src_slots, ...] -> [dst_slots, ...], one
    collective permute per round that carries rows (`broker_rounds.permutes`)."""
    take, put_at = tables["send"][0], tables["recv"][0]

    def one(x):
        if not permutes:
            return jnp.zeros((put_at.shape[0],) + x.shape[1:], x.dtype)
        buf = jnp.take(x, jnp.maximum(take, 0), axis=0)             # [sum of caps, ...]
        got = jnp.concatenate([lax.ppermute(buf[o:o + c], AXIS, list(perm))
                               for perm, o, c in permutes], axis=0)
        out = jnp.take(got, jnp.maximum(put_at, 0), axis=0)         # [dst_slots, ...]
        keep = (put_at >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, out, jnp.zeros((), x.dtype))
    return jax.tree.map(one, x_tree)


def _ragged(x_tree, tables):
    """Per-device body of the ragged form: one ragged all-to-all per leaf."""
    return jax.tree.map(lambda x: ragged_body(x, tables, axes=AXIS, scope="broker"), x_tree)


# ---- the broker -----------------------------------------------------------------------------
@dataclass
class _Tables:
    host: RoundTables | RaggedTables
    device: dict[str, jax.Array]


def _device_array(devices) -> np.ndarray:
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr


class Broker:
    """Moves dp-blocked pytrees from `src_mesh` to `dst_mesh` (module docstring).

    Holds the rounds of this mesh pair (`broker_rounds.device_rounds`); per `Routes`, the
    exchange index tables on device (the last `TABLES_KEPT`); per slot counts, the largest
    round sizes used so far; per shape key (leaf shapes/dtypes, round sizes, slot counts),
    the compiled exchange, which no route map changes;
    and zero buffers for destination-only devices keyed by shape and dtype (buffers are
    immutable, so reusing them is safe)."""

    def __init__(self, src_mesh: Mesh, dst_mesh: Mesh, exchange: str = "staged"):
        if exchange not in ("staged", "ragged"):
            raise ValueError(f"Broker.exchange={exchange!r}: use 'staged' or 'ragged'")
        self.exchange = exchange
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
        self.rounds = device_rounds(self.src_replicas, self.dst_replicas)
        self.shared_from = ordered_round_count(self.a, self.b) * max(
            len(r) for r in self.dst_replicas)  # device_rounds: one per replica index
        self.tables: dict[Routes, _Tables] = {}
        self.programs: dict[tuple, object] = {}
        self.caps: dict[tuple[int, int], tuple[int, ...]] = {}  # slots -> round sizes so far
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
        slots = (routes.src_slots, routes.dst_slots)
        t = self.tables.get(routes)
        if t is not None and t.host.caps == self.caps[slots]:
            return t
        if routes.src_ranks != self.a or routes.dst_ranks != self.b:
            raise ValueError(f"Broker: routes map dp {routes.src_ranks} -> {routes.dst_ranks} "
                             f"but the meshes have dp {self.a} -> {self.b}; build the Routes "
                             f"for these meshes")
        # Round sizes never shrink for given slot counts, so a run compiles at most one
        # program per growth of a round instead of flipping between sizes; all processes
        # make the same calls in the same order, so they agree on them.
        n = len(self.union_devices)
        host: RoundTables | RaggedTables
        if self.exchange == "ragged":
            ds = deliveries_array(routes, self.src_replicas, self.dst_replicas)
            need: tuple[int, ...] = ragged_caps(pair_counts(ds, n))
        else:
            need = needed_caps(routes, self.rounds, self.shared_from)
        caps = tuple(max(x, y) for x, y in zip(need, self.caps.get(slots, need)))
        self.caps[slots] = caps
        if self.exchange == "ragged":
            host = ragged_tables(ds, n, routes.src_slots, routes.dst_slots, (caps[0], caps[1]))
            arrays = host.device_arrays()
        else:
            host = round_tables(routes, self.rounds, n, caps)
            arrays = {"send": host.send, "recv": host.recv}
        device: dict[str, jax.Array] = {
            k: jax.make_array_from_callback(a.shape, self.union_sharding, a.__getitem__,
                                            dtype=a.dtype)
            for k, a in arrays.items()}
        if len(self.tables) >= TABLES_KEPT:
            del self.tables[next(iter(self.tables))]
        t = self.tables[routes] = _Tables(host, device)
        return t

    def _program(self, ins: list[jax.Array], t: _Tables):
        """The compiled exchange for these leaf shapes and round sizes: compiled once,
        whatever the route map."""
        key = (tuple((x.shape, x.dtype.str) for x in ins), self.exchange, t.host.caps,
               t.device["recv"].shape)
        prog = self.programs.get(key)
        if prog is None:
            prog = self.programs[key] = self.lowered(ins, t).compile()
        return prog

    def lowered(self, ins: list, t: _Tables, platforms: tuple[str, ...] | None = None):
        """The exchange program of `t` for leaves `ins`, lowered (for `platforms`, default
        this backend: the ragged form lowers for "cuda" from any host)."""
        if isinstance(t.host, RaggedTables):
            body = _ragged
        else:
            body = functools.partial(_exchange, permutes=permutes(self.rounds, t.host.caps))
        spec = {k: P(AXIS) for k in t.device}
        fn = jax.jit(jax.shard_map(body, mesh=self.union_mesh, in_specs=(P(AXIS), spec),
                                   out_specs=P(AXIS), check_vma=False))
        return fn.trace(ins, t.device).lower(lowering_platforms=platforms)

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
        outs = self._program(ins, t)(ins, t.device)
        if wait:
            jax.block_until_ready(outs)
        return jax.tree.unflatten(treedef, [self._from_union(y, routes.dst_slots) for y in outs])

    def _count(self, count: np.ndarray, leaves, src_slots: int) -> None:
        """Add one exchange's delivered bytes per device pair to `ledger` (shapes only)."""
        assert self.ledger is not None  # `transfer` counts only with a ledger
        part = sum(int(np.prod(x.shape[1:])) * np.dtype(x.dtype).itemsize for x in leaves)
        for u, v in zip(*np.nonzero(count)):
            key = (self.union_devices[u].id, self.union_devices[v].id)
            self.ledger[key] = self.ledger.get(key, 0) + int(count[u, v]) * part

    def transfer(self, x: jax.Array, routes: Routes, wait: bool = False) -> jax.Array:
        """Move one dp-blocked array by `routes` (see `transfer_tree`)."""
        return self.transfer_tree([x], routes, wait=wait)[0]
