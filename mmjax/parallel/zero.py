"""ZeRO-1 (P_os): optimizer state partitioned over the data-parallel axis of a stage's mesh.

Params keep their Megatron TP sharding; every optimizer-state leaf adds 'dp' on its first
free divisible dimension; per step one program reduce-scatters the gradients into those
shards (`sync`) and one runs optax on them and all-gathers the new params (`step`), clipped
by the norm over every stage's gradients, the factor one optimizer over all parameters
would use. Details: docs/design.md "ZeRO-1 and global-norm clipping". The same optimizer
serves a stage at ZeRO-2/3 (`zero_stage`: the gradients arrive as shards; at 3 the compute
copy stays sharded); where the shards live: parallel/zero_shards.py.
"""
from __future__ import annotations

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.mesh import put_global
from mmjax.parallel.tensor import mesh_param_specs
from mmjax.parallel.zero_shards import (_is_spec, _named, _padded, _scatter_blocks, add_dp,  # noqa: F401
                                        zero_axes, zero_shard_specs)


def opt_state_specs(opt_state, params, param_specs, dp: int, dp_axis="dp"):
    """PartitionSpec pytree for an optax state: a leaf whose path ends with a parameter's path
    and has its shape (mu, nu, ...) starts from that parameter's TP spec; every leaf then gets
    `add_dp`. Works on arrays or ShapeDtypeStructs."""
    by_path = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree.leaves(param_specs, is_leaf=_is_spec)):
        by_path[tuple(path)] = (tuple(leaf.shape), spec)

    def one(path, leaf):
        shape, base = tuple(leaf.shape), P()
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == shape:
                base = hit[1]
                break
        return add_dp(base, shape, dp, dp_axis)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def _clip(grads, norm, max_norm: float):
    """optax.clip_by_global_norm's rule with a given norm (scale min(1, max_norm / norm))."""
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(
        lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), grads)


def keep_if_nonfinite(ok, new, old):
    """`new` where the scalar `ok` holds, else `old` (leaf by leaf, on device): the
    non-finite-step guard of both training paths."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


class Zero1Optimizer:
    """ZeRO-1 wrapper of an optax transform for one stage's parameters on its ('dp', 'tp') mesh.

    `params`: the stage's trainable parameters (arrays or ShapeDtypeStructs, nnx.State or dict),
    fp32; `param_specs`: their TP specs (default: parallel/tensor.py rules for `mesh`); `tx`:
    the optimizer WITHOUT global-norm clipping; `clip_norm`: clip by the global norm handed
    to `step`; `dp_axes`: the mesh axes the state is split over (those of 'dp', 'cp'
    present). A stage with no trainable parameters gets no state and `step` is the
    identity.

    The pipeline's path (one gradient sync per step): `sync` reduce-scatters the step's
    per-rank partial gradients `[dp, ...]` (blocked over the mesh's 'dp' axis) straight into
    the ZeRO-1 shards in ONE flat reduce-scatter; `step` runs AdamW on the float32 master
    shards (`shard_specs`) and returns them with the compute copy (`compute_dtype`,
    replicated over dp) from ONE flat all-gather. `norm_skip`: top-level parameter names
    left out of this stage's norm term (the last stage's copy of a tied embedding).
    `rank_axes`: the mesh axes the partials' leading rank axis is blocked over: ('dp',), or
    ('dp', 'cp') for a CP stage whose cp ranks keep their own partials (then the one
    reduce-scatter covers dp x cp, Megatron-LM's gradient reduction over the dp x cp group).
    `zero_stage` 2 or 3: the gradients arrive already reduce-scattered into the shards (each
    backward's, pipeline/stage.py), so `sync` only computes the norm term; at 3 `step`
    returns the compute copy sharded like the master (no all-gather: each layer is gathered
    in the layer scan).
    """

    def __init__(self, tx: optax.GradientTransformation, mesh: Mesh, params,
                 param_specs=None, clip_norm: float | None = None,
                 dp_axes: tuple[str, ...] = ("dp", "cp"), donate: bool = False,
                 compute_dtype=jnp.float32, norm_skip: tuple[str, ...] = (),
                 rank_axes: tuple[str, ...] = ("dp",), zero_stage: int = 1, tx_at=None):
        self.tx, self.mesh, self.clip_norm = tx, mesh, clip_norm
        self.zero_stage = zero_stage
        self.dp, dp_axis = zero_axes(mesh, dp_axes)
        self._dp_axis = dp_axis
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
            if leaf.dtype != jnp.float32:
                raise ValueError(f"parameter {jax.tree_util.keystr(path)} is {leaf.dtype}; "
                                 f"ZeRO-1 keeps float32 master weights: cast params to float32")
        self.has_state = bool(jax.tree.leaves(abstract))
        specs = mesh_param_specs(abstract, mesh) if param_specs is None else param_specs
        self.param_specs = specs
        self.param_shardings = _named(mesh, specs)
        self.shard_specs = zero_shard_specs(abstract, mesh, specs, dp_axes)
        state_shape = jax.eval_shape(tx.init, abstract)
        self.state_specs = opt_state_specs(state_shape, abstract, specs, self.dp, dp_axis)
        self.state_shardings = _named(mesh, self.state_specs)
        replicated = NamedSharding(mesh, P())
        self._init = jax.jit(tx.init, in_shardings=(self.param_shardings,),
                             out_shardings=self.state_shardings)
        self._replicated = replicated
        self.grad_shard_shardings = _named(mesh, self.shard_specs)

        # ---- the pipeline's path: flat sync and fused update + all-gather ----
        self.compute_dtype = compute_dtype
        rank_axes = tuple(a for a in rank_axes if a in mesh.axis_names)
        self._rank_axes = rank_axes
        rank_entry = rank_axes[0] if len(rank_axes) == 1 else rank_axes
        self.rank_partial_shardings = jax.tree.map(
            lambda s, a: NamedSharding(mesh, P(rank_entry, *_padded(s, len(a.shape)))),
            specs, abstract, is_leaf=_is_spec)
        self.master_shardings = self.grad_shard_shardings
        self._in_norm = tuple(not (path and getattr(path[0], "key", None) in norm_skip)
                              for path, _ in jax.tree_util.tree_leaves_with_path(abstract))
        self._abstract = abstract
        every = tuple(mesh.axis_names)
        self.sq_sharding = NamedSharding(mesh, P(every))
        if zero_stage >= 2:  # the accumulators are the shards: the norm term alone
            self._sync = jax.jit(self._squares_impl, in_shardings=(self.grad_shard_shardings,),
                                 out_shardings=(self.grad_shard_shardings, self.sq_sharding))
        else:
            self._sync = jax.jit(self._sync_impl, in_shardings=(self.rank_partial_shardings,),
                                 out_shardings=(self.grad_shard_shardings, self.sq_sharding))
        self.compute_shardings = (self.master_shardings if zero_stage == 3
                                  else _named(mesh, specs))
        self.tx_at = tx_at  # the learning rate an input (train/optimizer.py rate_as_input)
        self._step = jax.jit(
            self._step_impl,
            in_shardings=(self.master_shardings, self.grad_shard_shardings,
                          self.state_shardings, replicated)
            + ((replicated,) if tx_at is not None else ()),
            out_shardings=(self.master_shardings, self.state_shardings,
                           self.compute_shardings),
            donate_argnums=(0, 2) if donate else ())  # grad shards: no output to alias

    def init(self, params):
        """Optimizer state, every leaf sharded over 'dp' (see module docstring)."""
        if not self.has_state:
            return optax.EmptyState()
        return self._init(jax.tree.map(put_global, params, self.param_shardings))

    # ---- one gradient sync per step --------------------------------------------------
    def _split_dim(self, spec, ndim: int):
        """The dimension ZeRO-1 splits over dp in a shard spec (None: replicated leaf)."""
        for i, a in enumerate(_padded(spec, ndim)):
            if a == self._dp_axis:
                return i
        return None

    def _owner(self, spec, ndim: int):
        """1.0 on the devices that hold replica 0 of a leaf sharded as `spec` (so a sum of
        per-device terms counts every element once), else 0.0; inside shard_map."""
        used: set[str] = set()
        for a in _padded(spec, ndim):
            used.update(a if isinstance(a, tuple) else (a,))
        first = jnp.ones((), jnp.float32)
        for name in self.mesh.axis_names:
            if name not in used and self.mesh.shape[name] > 1:
                first = first * (jax.lax.axis_index(name) == 0).astype(jnp.float32)
        return first

    def _sync_impl(self, partials):
        flat_specs, tree = jax.tree.flatten(self.shard_specs, is_leaf=_is_spec)
        in_specs = tuple(sh.spec for sh in jax.tree.leaves(self.rank_partial_shardings))
        in_norm = self._in_norm
        scatter = _scatter_blocks(self.mesh, flat_specs, self._rank_axes, self._dp_axis)

        def body(*blocks):
            out = scatter([b[0] for b in blocks])  # this rank's partial sums, tp-local shapes
            return out, self._square_sum(out, flat_specs, in_norm).reshape(1)

        every = tuple(self.mesh.axis_names)
        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                               out_specs=(list(flat_specs), P(every)), check_vma=False)
        shards, sq = mapped(*jax.tree.leaves(partials))
        return jax.tree.unflatten(tree, shards), sq

    def _square_sum(self, shards, flat_specs, in_norm):
        """This device's term of the squared norm (each element counted once over replicas)."""
        sq = jnp.zeros((), jnp.float32)
        for k, (g, s) in enumerate(zip(shards, flat_specs)):
            if in_norm[k]:
                sq = sq + self._owner(s, g.ndim) * jnp.sum(jnp.square(g))
        return sq

    def _squares_impl(self, shards):
        """ZeRO-2/3: the gradients arrive as shards already (reduce-scattered in each
        backward); only the norm term is left."""
        flat_specs, _ = jax.tree.flatten(self.shard_specs, is_leaf=_is_spec)
        every = tuple(self.mesh.axis_names)
        mapped = jax.shard_map(
            lambda *b: self._square_sum(b, flat_specs, self._in_norm).reshape(1),
            mesh=self.mesh, in_specs=tuple(flat_specs), out_specs=P(every), check_vma=False)
        return shards, mapped(*jax.tree.leaves(shards))

    def sync(self, partials):
        """Per-rank partial gradients `[ranks, ...]` (`rank_partial_shardings`: ranks = dp,
        or dp * cp) -> (grad shards on `grad_shard_shardings`, per-device sums of squares
        `[devices]` whose total is this stage's term of the global norm's square). One
        program; its only collectives are one flat reduce-scatter over `rank_axes` (plus one
        flat all-reduce for leaves with no dimension divisible by their size); the norm term
        needs none."""
        if not self.has_state:
            return partials, None
        return self._sync(partials)

    def _step_impl(self, master, grad_shards, opt_state, norm, learning_rate=None):
        g = _clip(grad_shards, norm, self.clip_norm) if self.clip_norm else grad_shards
        tx = self.tx if learning_rate is None else self.tx_at(learning_rate)
        updates, new_state = tx.update(g, opt_state, master)
        new_master = optax.apply_updates(master, updates)
        new_master, new_state = keep_if_nonfinite(jnp.isfinite(norm), (new_master, new_state),
                                                  (master, opt_state))
        return new_master, new_state, self._gather(new_master)

    def _gather(self, master):
        """fp32 master shards -> the compute copy (compute dtype, replicated over dp): one
        flat all-gather over the ZeRO axes."""
        flat_specs, tree = jax.tree.flatten(self.shard_specs, is_leaf=_is_spec)
        out_specs = list(jax.tree.leaves(self.param_specs, is_leaf=_is_spec))
        dtype, axes = self.compute_dtype, self._dp_axis
        if self.zero_stage == 3:  # ZeRO-3: the compute copy stays sharded like the master
            return jax.tree.map(lambda b: b.astype(dtype) if jnp.issubdtype(
                b.dtype, jnp.floating) else b, master)

        def body(*blocks):
            blocks = [b.astype(dtype) if jnp.issubdtype(b.dtype, jnp.floating) else b
                      for b in blocks]
            dims = [self._split_dim(s, b.ndim) for s, b in zip(flat_specs, blocks)]
            split = [k for k, d in enumerate(dims) if d is not None]
            out = list(blocks)
            if split and axes is not None:
                moved = [jnp.moveaxis(blocks[k], dims[k], 0) for k in split]
                buf = jnp.concatenate([m.reshape(1, -1) for m in moved], axis=1)
                buf = jax.lax.all_gather(buf, axes, axis=0, tiled=True)  # [dp, T]
                off = 0
                for k, m in zip(split, moved):
                    n = m.size
                    piece = buf[:, off:off + n].reshape((buf.shape[0] * m.shape[0],)
                                                       + m.shape[1:])
                    off += n
                    out[k] = jnp.moveaxis(piece, 0, dims[k])
            return out

        mapped = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(flat_specs),
                               out_specs=out_specs, check_vma=False)
        return jax.tree.unflatten(tree, mapped(*jax.tree.leaves(master)))

    def step(self, master, grad_shards, opt_state, global_grad_norm, learning_rate=None):
        """-> (new master shards, new opt_state, compute params): AdamW (clipped by
        `global_grad_norm`, skipped when it is not finite) on the float32 master shards and
        one all-gather of the result in the compute dtype, in one program. `learning_rate`:
        the step's rate, with `tx_at` (required then)."""
        if not self.has_state:
            return master, opt_state, master
        scalars = [global_grad_norm] + ([] if self.tx_at is None else [learning_rate])
        if self._replicated.is_fully_addressable:
            scalars = [jax.device_put(jnp.asarray(x, jnp.float32), self._replicated)
                       for x in scalars]
            master = jax.device_put(master, self.master_shardings)
            opt_state = jax.device_put(opt_state, self.state_shardings)
        else:
            scalars = [put_global(np.asarray(x, np.float32), self._replicated)
                       for x in scalars]
        return self._step(master, grad_shards, opt_state, *scalars)

    def lower_step(self, master, grad_shards, opt_state):
        scalar = jax.ShapeDtypeStruct((), jnp.float32, sharding=self._replicated)
        return self._step.lower(master, grad_shards, opt_state,
                                *[scalar] * (1 if self.tx_at is None else 2))

def state_bytes_per_device(opt_state) -> int:
    """Largest optimizer-state footprint on any one device (bytes), from the leaves'
    shardings (shard shape x itemsize), for the memory report."""
    per_device: defaultdict[jax.Device, int] = defaultdict(int)
    for leaf in jax.tree.leaves(opt_state):
        if not isinstance(leaf, jax.Array):
            continue
        shard = leaf.sharding.shard_shape(leaf.shape)
        nbytes = int(np.prod(shard, dtype=np.int64)) * leaf.dtype.itemsize
        for device in leaf.sharding.device_set:
            per_device[device] += nbytes
    return max(per_device.values(), default=0)
