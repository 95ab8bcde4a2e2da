"""Communication broker: move dp-blocked tensors between disjoint sub-meshes (DistTrain §7).

A stage with DP size a sends to one with DP size b keeping sample order (or any part map:
OrchMLLM §6 rearrangement composition), by rounds of `lax.ppermute` inside `shard_map` over
the union of the two meshes' devices, so the same code works across processes. Every process
holding devices of either mesh calls `transfer` with the same arguments in the same order.
Layout, round construction (König edge colouring) and the XLA:CPU caveat: docs/design.md
"The broker".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.data.routes import Routes

AXIS = "broker"  # the 1-D union mesh's axis


# ---- which part goes where ------------------------------------------------------------------
# ---- round tables (host, once per Routes) ---------------------------------------------------
@dataclass(frozen=True)
class RoundTables:
    """Per round r, `perms[r]` are the (sender, receiver) union indices of that ppermute;
    `send[d, r]` / `recv[d, r]` the slot union device d sends / receives in round r (-1:
    none)."""

    perms: tuple[tuple[tuple[int, int], ...], ...]
    send: np.ndarray  # [n, max(rounds, 1)] int32
    recv: np.ndarray  # [n, max(rounds, 1)] int32

    @property
    def rounds(self) -> int:
        return len(self.perms)


def _edge_colouring(edges: list[tuple[int, int]]) -> list[int]:
    """Colour a bipartite multigraph's edges (sender u, receiver v) so no two edges at a node
    share a colour, using exactly max-degree colours (König; alternating-path recolouring)."""
    at_s: dict[int, dict[int, int]] = {}
    at_r: dict[int, dict[int, int]] = {}
    colour = [-1] * len(edges)

    def first_free(used: dict[int, int]) -> int:
        c = 0
        while c in used:
            c += 1
        return c

    for e, (u, v) in enumerate(edges):
        su, rv = at_s.setdefault(u, {}), at_r.setdefault(v, {})
        a, b = first_free(su), first_free(rv)
        if a in rv and b not in su:
            a = b
        elif a in rv:
            # Swap colours a/b on the path from v alternating a, b, a, ...; it cannot reach
            # u (a is free there), and afterwards a is free at v.
            path, side, node, col = [], "r", v, a
            while True:
                tbl = at_r if side == "r" else at_s
                f = tbl.get(node, {}).get(col)
                if f is None:
                    break
                path.append(f)
                side, node = ("s", edges[f][0]) if side == "r" else ("r", edges[f][1])
                col = b if col == a else a
            for f in path:
                del at_s[edges[f][0]][colour[f]], at_r[edges[f][1]][colour[f]]
            for f in path:
                colour[f] = b if colour[f] == a else a
                at_s[edges[f][0]][colour[f]] = at_r[edges[f][1]][colour[f]] = f
        colour[e] = a
        su[a] = rv[a] = e
    return colour


def round_tables(routes: Routes, src_replicas: list[list[int]],
                 dst_replicas: list[list[int]], n: int) -> RoundTables:
    """Plan the ppermute rounds. `src_replicas[i]` / `dst_replicas[j]` are the union indices
    of the devices holding dp rank i / j (their tp/cp replicas); `n` the union size.
    Every part goes to every replica of its destination rank; a receiver that is itself a
    replica of the source rank sends to itself, otherwise the least-loaded source replica
    sends. Then one round per colour of the delivery multigraph."""
    load = {d: 0 for reps in src_replicas for d in reps}
    edges, slots = [], []
    for i, s, j, q in routes.pairs:
        reps = src_replicas[i]
        for r in dst_replicas[j]:
            u = r if r in reps else min(reps, key=lambda d: (load[d], reps.index(d)))
            load[u] += 1
            edges.append((u, r))
            slots.append((s, q))
    colour = _edge_colouring(edges)
    rounds = max(colour, default=-1) + 1
    send = np.full((n, max(rounds, 1)), -1, np.int32)
    recv = np.full((n, max(rounds, 1)), -1, np.int32)
    perms: list[list[tuple[int, int]]] = [[] for _ in range(rounds)]
    for (u, v), (s, q), c in zip(edges, slots, colour):
        send[u, c], recv[v, c] = s, q
        perms[c].append((u, v))
    return RoundTables(tuple(tuple(sorted(p)) for p in perms), send, recv)


def _permute_rounds(perms, dst_slots, x_tree, send, recv):
    """Per-device body inside shard_map: x leaves [src_slots, ...] -> [dst_slots, ...]."""
    def one(x):
        out = jnp.zeros((dst_slots,) + x.shape[1:], x.dtype)
        for r, perm in enumerate(perms):
            piece = lax.dynamic_slice_in_dim(x, jnp.maximum(send[0, r], 0), 1, axis=0)
            got = lax.ppermute(piece, AXIS, perm)
            q = recv[0, r]
            qc = jnp.maximum(q, 0)
            cur = lax.dynamic_slice_in_dim(out, qc, 1, axis=0)
            out = lax.dynamic_update_slice_in_dim(out, jnp.where(q >= 0, got, cur), qc, axis=0)
        return out
    return jax.tree.map(one, x_tree)


# ---- the broker -----------------------------------------------------------------------------
@dataclass
class _Compiled:
    tables: RoundTables
    send: jax.Array
    recv: jax.Array
    fn: object


def _device_array(devices) -> np.ndarray:
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    return arr


class Broker:
    """Moves dp-blocked pytrees from `src_mesh` to `dst_mesh` (module docstring).

    Holds, per `Routes`, the round tables and the jitted shard_map (an explicit per-instance
    dict), and zero buffers for destination-only devices keyed by shape and dtype (buffers
    are immutable, so reusing them is safe)."""

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
        self.compiled: dict[Routes, _Compiled] = {}
        self.zeros: dict[tuple, jax.Array] = {}

    @staticmethod
    def _ranks(mesh: Mesh) -> list[list]:
        """Per dp rank, its devices (the replicas over the other axes), in mesh order."""
        devs = np.moveaxis(mesh.devices, mesh.axis_names.index("dp"), 0)
        return [list(devs[i].flat) for i in range(devs.shape[0])]

    # ---- host-side preparation ---------------------------------------------------------------
    def _compiled(self, routes: Routes) -> _Compiled:
        c = self.compiled.get(routes)
        if c is not None:
            return c
        if routes.src_ranks != self.a or routes.dst_ranks != self.b:
            raise ValueError(f"Broker: routes map dp {routes.src_ranks} -> {routes.dst_ranks} "
                             f"but the meshes have dp {self.a} -> {self.b}; build the Routes "
                             f"for these meshes")
        n = len(self.union_devices)
        tables = round_tables(routes, self.src_replicas, self.dst_replicas, n)
        sharding = self.union_sharding
        send, recv = (jax.make_array_from_callback(t.shape, sharding, lambda idx, t=t: t[idx],
                                                   dtype=t.dtype)
                      for t in (tables.send, tables.recv))
        body = partial(_permute_rounds, tables.perms, routes.dst_slots)
        fn = jax.jit(jax.shard_map(body, mesh=self.union_mesh, in_specs=(P(AXIS),) * 3,
                                   out_specs=P(AXIS), check_vma=False))
        c = self.compiled[routes] = _Compiled(tables, send, recv, fn)
        return c

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
        then block until this process's part of the ppermutes is done (multi-process CPU
        runs, where two gloo collectives in flight can deadlock)."""
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            return tree
        if self.same_mesh and routes.is_identity:
            return jax.tree.unflatten(treedef, [
                x if isinstance(x, jax.Array) and x.sharding == self.dst_sharding
                else jax.device_put(x, self.dst_sharding) for x in leaves])
        c = self._compiled(routes)
        ins = [self._to_union(x, routes.src_slots) for x in leaves]
        outs = c.fn(ins, c.send, c.recv)
        if wait:
            jax.block_until_ready(outs)
        return jax.tree.unflatten(treedef, [self._from_union(y, routes.dst_slots) for y in outs])

    def transfer(self, x: jax.Array, routes: Routes, wait: bool = False) -> jax.Array:
        """Move one dp-blocked array by `routes` (see `transfer_tree`)."""
        return self.transfer_tree([x], routes, wait=wait)[0]
