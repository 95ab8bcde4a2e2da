"""Where a stage's ZeRO state lives and how gradients reach it: shard specs (the TP spec plus
the ZeRO group's axes on the first free dimension they divide), the FSDP-group view of a
stage mesh (hybrid sharding, OrchMLLM §7), the one flat reduce-scatter of per-rank partial
gradients into the shards (ZeRO-1's per-step sync, ZeRO-2's per-backward one), and ZeRO-3's
per-layer gather for the layer scan. parallel/zero.py's optimizer and pipeline/stage.py use
them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.tensor import mesh_param_specs, tp_leaf_spec


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def add_dp(spec: P, shape: tuple[int, ...], dp: int, dp_axis="dp") -> P:
    """`spec` plus `dp_axis` (a name, or a tuple of names of total size `dp`) on the first
    dimension of `shape` that is unsharded and divisible by `dp`; unchanged when dp == 1 or no
    dimension qualifies (the leaf stays replicated)."""
    if dp <= 1:
        return spec
    entries = list(_padded(spec, len(shape)))
    for i, size in enumerate(shape):
        if entries[i] is None and size % dp == 0:
            entries[i] = dp_axis
            return P(*entries)
    return spec


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _scatter_blocks(mesh: Mesh, flat_specs, rank_axes, dp_axis):
    """Inside a shard_map: each rank's partial-gradient blocks (tp-local, whole over dp) ->
    its ZeRO shards (`flat_specs`), summed over `rank_axes` by ONE flat reduce-scatter
    (Megatron's contiguous buffer), plus one flat all-reduce for leaves with no dimension
    the group divides. Shared by the per-step sync (ZeRO-1) and each backward (ZeRO-2)."""
    ranks = tuple(a for a in rank_axes if mesh.shape[a] > 1)
    zero = (dp_axis,) if isinstance(dp_axis, str) else (dp_axis or ())
    reps = tuple(a for a in ranks if a not in zero)  # hybrid sharding: the groups' axis
    every = ranks[0] if len(ranks) == 1 else ranks
    ranks = tuple(a for a in ranks if a in zero)
    dp_size = int(np.prod([mesh.shape[a] for a in ranks], dtype=np.int64))
    red = ranks[0] if len(ranks) == 1 else ranks  # the axes the one reduce-scatter covers
    rest = [a for a in zero if a not in ranks]
    rest_size = int(np.prod([mesh.shape[a] for a in rest], dtype=np.int64))

    def split_dim(spec, ndim: int):
        for i, a in enumerate(_padded(spec, ndim)):
            if a == dp_axis:
                return i
        return None

    def scatter(blocks):
        dims = [split_dim(s, b.ndim) for s, b in zip(flat_specs, blocks)]
        split = [k for k, d in enumerate(dims) if d is not None]
        whole = [k for k, d in enumerate(dims) if d is None]
        out = list(blocks)
        if split:
            moved = [jnp.moveaxis(blocks[k], dims[k], 0) for k in split]
            buf = jnp.concatenate([m.reshape(dp_size, -1) for m in moved], axis=1)
            if dp_size > 1:
                buf = jax.lax.psum_scatter(buf, red, scatter_dimension=0, tiled=True)
            if reps:  # across the FSDP groups: the shards' all-reduce (OrchMLLM §7)
                buf = jax.lax.psum(buf, reps[0] if len(reps) == 1 else reps)
            off = 0
            for k, m in zip(split, moved):
                n = m.size // dp_size
                piece = buf[0, off:off + n].reshape((m.shape[0] // dp_size,) + m.shape[1:])
                off += n
                if rest_size > 1:  # ZeRO over ('dp', 'cp'): this cp rank's slice
                    idx = jax.lax.axis_index(rest[0] if len(rest) == 1 else tuple(rest))
                    size = piece.shape[0] // rest_size
                    piece = jax.lax.dynamic_slice_in_dim(piece, idx * size, size, 0)
                out[k] = jnp.moveaxis(piece, 0, dims[k])
        if whole and every:  # leaves too small to split: one flat all-reduce
            buf = jax.lax.psum(jnp.concatenate([blocks[k].reshape(-1) for k in whole]), every)
            off = 0
            for k in whole:
                out[k] = buf[off:off + blocks[k].size].reshape(blocks[k].shape)
                off += blocks[k].size
        return out
    return scatter


def reduce_scatter_partials(mesh: Mesh, shard_specs, partial_specs, rank_axes, dp_axis):
    """partials `[ranks, ...]` (on `partial_specs`) -> their sum over the ranks on
    `shard_specs`, as one flat reduce-scatter: what a ZeRO-2 stage's backward adds to its
    sharded accumulators (pipeline/stage.py)."""
    flat_specs, tree = jax.tree.flatten(shard_specs, is_leaf=_is_spec)
    scatter = _scatter_blocks(mesh, flat_specs, rank_axes, dp_axis)
    mapped = jax.shard_map(lambda *b: scatter([x[0] for x in b]), mesh=mesh,
                           in_specs=tuple(jax.tree.leaves(partial_specs, is_leaf=_is_spec)),
                           out_specs=list(flat_specs), check_vma=False)
    return lambda partials: jax.tree.unflatten(tree, mapped(*jax.tree.leaves(partials)))


def zero_mesh(mesh: Mesh, group: int = 0) -> Mesh:
    """The mesh a stage's ZeRO state lives on: `group` devices per FSDP group (0, or all of
    them: the stage mesh itself). Hybrid sharding (OrchMLLM §7): the same devices with 'dp'
    split into ('rep', 'dp'), 'dp' the group's consecutive dp ranks (contiguous devices),
    'rep' the groups; ZeRO shards over 'dp' (and 'cp') and replicates over 'rep'."""
    n = mesh.devices.size
    if not group or group == n:
        return mesh
    per_rank = n // mesh.shape["dp"]  # cp x tp devices per dp rank
    inner = group // per_rank
    names = ("rep",) + tuple(mesh.axis_names)
    return Mesh(mesh.devices.reshape((mesh.shape["dp"] // inner, inner)
                                     + mesh.devices.shape[1:]), names,
                axis_types=(AxisType.Auto,) * len(names))


def zero_axes(mesh: Mesh, dp_axes=("dp", "cp")):
    """(the ZeRO group's size, its mesh axis entry: a name, a tuple of names, or None)."""
    axes = tuple(a for a in dp_axes if a in mesh.axis_names and mesh.shape[a] > 1)
    dp = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    return dp, (axes[0] if len(axes) == 1 else (axes or None))


def zero_shard_specs(abstract, mesh: Mesh, param_specs=None, dp_axes=("dp", "cp")):
    """Each leaf's ZeRO shard spec: its TP spec plus the group's axes on its first free
    dimension they divide (master weights, optimizer state, ZeRO-2/3 gradients, ZeRO-3
    compute weights)."""
    dp, dp_axis = zero_axes(mesh, dp_axes)
    specs = mesh_param_specs(abstract, mesh) if param_specs is None else param_specs
    return jax.tree.map(lambda s, a: add_dp(s, a.shape, dp, dp_axis), specs, abstract,
                        is_leaf=_is_spec)


def zero_shardings(tree, mesh: Mesh):
    """NamedShardings of `zero_shard_specs` (arrays or ShapeDtypeStructs)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
    return _named(mesh, zero_shard_specs(abstract, mesh))


def zero3_layer_gather(mesh: Mesh):
    """ZeRO-3 on a pipeline stage's mesh: `scan.layer_weights`' function (parallel/fsdp.py
    `layer_gather`) that keeps the stacked layers on their ZeRO shards (`zero_shard_specs`
    of one layer) and gathers each layer whole over dp (but for its tp dimension) inside
    the scan body. A layer's paths are relative: "layers" in front gives the block rules."""
    from mmjax.parallel.fsdp import layer_gather

    tp = "tp" in mesh.axis_names and mesh.shape["tp"] > 1
    dp, dp_axis = zero_axes(mesh)

    def spec(names, shape, stacked):
        base = tp_leaf_spec(("layers",) + names, len(shape)) if tp else P()
        return add_dp(base, shape, dp, dp_axis) if stacked else base
    return layer_gather(mesh, spec)
