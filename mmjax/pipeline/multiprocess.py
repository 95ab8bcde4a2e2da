"""The runtime's multi-process pieces: which meshes hold this process's devices, global
arrays from host values, shape-only stand-ins for values other processes hold, and scalar
totals gathered across processes (docs/design.md "The runtime in several processes")."""
from __future__ import annotations

import jax
import numpy as np

from mmjax.parallel.mesh import put_global
from mmjax.parallel.tensor import shard_state, state_shardings


def holds_local_device(mesh) -> bool:
    return any(d.process_index == jax.process_index() for d in mesh.devices.flat)


def sync_collectives() -> bool:
    """True on multi-process CPU runs: gloo may deadlock with two collectives in flight."""
    return jax.process_count() > 1 and jax.devices()[0].platform == "cpu"


def global_put(tree, shardings, batched: bool = False):
    """`put_global` over a tree of arrays and their shardings; `batched`: one `device_put`
    of all leaves when every sharding is this process's alone (the feeds of a step)."""
    if batched:
        leaves, treedef = jax.tree.flatten(tree)
        shards = jax.tree.leaves(shardings)  # the same structure: one sharding per leaf
        if len(shards) == len(leaves) and all(s.is_fully_addressable for s in shards):
            return jax.tree.unflatten(treedef, jax.device_put(leaves, shards))
    return jax.tree.map(put_global, tree, shardings)


def abstract(tree):
    """Shapes and dtypes only (values held by other processes)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), tree)


def placeholders(tree, sharding):
    """Arrays with no addressable shard (this process owns none of `sharding`'s devices), to
    stand for another process's values in a broker transfer."""
    return jax.tree.map(lambda a: jax.make_array_from_single_device_arrays(
        a.shape, sharding, [], dtype=a.dtype), tree)


def gather_scalars(groups: list[list]) -> list[np.ndarray]:
    """Device scalars or per-rank vectors (summed), some held by other processes
    (ShapeDtypeStructs here), -> their totals on every process: each process adds the
    shards it holds as replica 0, the others zero, and one `process_allgather` sums the
    contributions (each element counted once)."""
    from jax.experimental import multihost_utils

    flat = [v for g in groups for v in g]
    mine = np.zeros(len(flat), np.float64)
    for k, v in enumerate(flat):
        if isinstance(v, jax.Array):
            mine[k] = sum(float(np.sum(np.asarray(sh.data, np.float64)))
                          for sh in v.addressable_shards if sh.replica_id == 0)
    total = np.asarray(multihost_utils.process_allgather(mine)).sum(axis=0)
    out, k = [], 0
    for g in groups:
        out.append(total[k:k + len(g)])
        k += len(g)
    return out


def place_state(state, mesh):
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
