"""The ZeRO-1 update API that production no longer runs, kept for the tests of
test_tensor_zero.py: `update` on gradients already summed over dp (replicated), the
per-leaf `reduce_scatter` + `update_from_shards`, and the global norm over stages' full
gradients. The trainer's path is `Zero1Optimizer.sync` + `Zero1Optimizer.step`
(parallel/zero.py); these share its layout (shard, state and param specs), so the tests
below still check that layout against a single optax optimizer."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.mesh import put_global
from mmjax.parallel.zero import (Zero1Optimizer, _clip, _is_spec, _named, _padded,
                                 keep_if_nonfinite)
from mmjax.train.optimizer import make_optimizer


@jax.jit
def grad_sq_norm(grads):
    """Sum of squares of every gradient leaf (one stage's contribution to the global norm)."""
    return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)),
               jnp.zeros((), jnp.float32))


def global_grad_norm(grads_per_stage, device=None):
    """L2 norm over the gradients of ALL stages (each tree on its own mesh). The per-stage sums
    of squares are computed on their meshes and only the scalars move to `device` (default:
    this process's first device); no host sync. Stages in other processes: sum their
    `grad_sq_norm`s across processes (e.g. jax.experimental.multihost_utils.process_allgather)
    and pass sqrt of the total to `update` as a host float."""
    device = jax.local_devices()[0] if device is None else device
    total = jnp.zeros((), jnp.float32)
    total = jax.device_put(total, device)
    for grads in grads_per_stage:
        if jax.tree.leaves(grads):
            total = total + jax.device_put(grad_sq_norm(grads), device)
    return jnp.sqrt(total)


class Zero1Reference(Zero1Optimizer):
    """`Zero1Optimizer` plus its former update API (no buffer donation)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._update = jax.jit(
            self._update_shard,
            in_shardings=(self.param_shardings, self.param_shardings, self.state_shardings,
                          self._replicated),
            out_shardings=(self.param_shardings, self.state_shardings))
        # dp-partial gradients: [dp, *shape], rank r's un-reduced sum on its dp slot.
        self.partial_shardings = jax.tree.map(
            lambda s, a: NamedSharding(self.mesh, P(self._dp_axis, *_padded(s, len(a.shape)))),
            self.param_specs, self._abstract, is_leaf=_is_spec)
        self._reduce_scatter = jax.jit(
            self._reduce_scatter_impl, in_shardings=(self.partial_shardings,),
            out_shardings=(self.grad_shard_shardings, self._replicated))
        self._update_from_shards = jax.jit(
            self._update_shard,
            in_shardings=(self.param_shardings, self.grad_shard_shardings,
                          self.state_shardings, self._replicated),
            out_shardings=(self.param_shardings, self.state_shardings))

    def _update_shard(self, params, grads, opt_state, norm):
        """A non-finite `norm` (the trainer folds a non-finite loss into it) leaves params
        and state as they were: the step is skipped on device, with no host sync."""
        to_shard = lambda t: jax.lax.with_sharding_constraint(t, _named(self.mesh,
                                                                        self.shard_specs))
        p, g = to_shard(params), to_shard(grads)
        if self.clip_norm:
            g = _clip(g, norm, self.clip_norm)
        updates, new_state = self.tx.update(g, opt_state, p)
        new_p = to_shard(optax.apply_updates(p, updates))
        return keep_if_nonfinite(jnp.isfinite(norm), (new_p, new_state), (params, opt_state))

    def update(self, params, grads, opt_state, global_grad_norm=None):
        """-> (new params, new opt_state). `grads`: summed over microbatches and dp, replicated
        over dp with the params' TP sharding. `global_grad_norm`: the norm over all stages'
        grads (scalar, any device or host); None clips with this stage's own norm."""
        if not self.has_state:
            return params, opt_state
        if global_grad_norm is None:
            global_grad_norm = jnp.sqrt(grad_sq_norm(grads)) if self.clip_norm else 0.0
        if self._replicated.is_fully_addressable:
            norm = jax.device_put(jnp.asarray(global_grad_norm, jnp.float32), self._replicated)
            # No-ops when the inputs already carry these shardings; otherwise an async reshard
            # (e.g. grads whose sharding GSPMD chose differently), instead of jit's mismatch
            # error.
            params, grads = (jax.device_put(t, self.param_shardings) for t in (params, grads))
            opt_state = jax.device_put(opt_state, self.state_shardings)
        else:  # mesh spanning processes: inputs already global; norm is a host float
            norm = put_global(np.asarray(global_grad_norm, np.float32), self._replicated)
        return self._update(params, grads, opt_state, norm)

    def _reduce_scatter_impl(self, partial):
        def local(spec):
            def one(block):  # [1, *tp-local shape], this dp rank's partial sum
                block = block[0]
                if self._dp_axis is None:
                    return block
                dims = [i for i, a in enumerate(_padded(spec, block.ndim))
                        if a == self._dp_axis]
                if not dims:  # no dimension to split: plain all-reduce, stays replicated
                    return jax.lax.psum(block, self._dp_axis)
                return jax.lax.psum_scatter(block, self._dp_axis, scatter_dimension=dims[0],
                                            tiled=True)
            return one

        in_specs = jax.tree.map(lambda sh: sh.spec, self.partial_shardings)
        flat_specs, tree = jax.tree.flatten(self.shard_specs, is_leaf=_is_spec)
        mapped = jax.shard_map(
            lambda *blocks: [local(s)(b) for s, b in zip(flat_specs, blocks)],
            mesh=self.mesh, in_specs=tuple(jax.tree.leaves(in_specs, is_leaf=_is_spec)),
            out_specs=flat_specs)
        grads = jax.tree.unflatten(tree, mapped(*jax.tree.leaves(partial)))
        return grads, grad_sq_norm(grads)

    def reduce_scatter(self, partial_grads):
        """dp-partial gradients -> (grad shards, their sum of squares). `partial_grads`: per
        parameter [dp, *shape], slot r holding dp rank r's un-reduced sum (sharding
        `partial_shardings`: P('dp', *tp spec)). XLA reduce-scatters them straight into the
        ZeRO-1 shards (ZeRO's P_os with a reduce-scatter instead of an all-reduce); the
        sum of squares is this stage's term of `global_grad_norm`'s square."""
        if not self.has_state:
            return partial_grads, jnp.zeros((), jnp.float32)
        return self._reduce_scatter(jax.device_put(partial_grads, self.partial_shardings))

    def update_from_shards(self, params, grad_shards, opt_state, global_grad_norm):
        """`update` for grads already in the ZeRO-1 shards (from `reduce_scatter`);
        `global_grad_norm`: sqrt of the sum of every stage's `reduce_scatter` square."""
        if not self.has_state:
            return params, opt_state
        norm = jax.device_put(jnp.asarray(global_grad_norm, jnp.float32), self._replicated)
        params = jax.device_put(params, self.param_shardings)
        grad_shards = jax.device_put(grad_shards, self.grad_shard_shardings)
        opt_state = jax.device_put(opt_state, self.state_shardings)
        return self._update_from_shards(params, grad_shards, opt_state, norm)

    def lower_update(self, params, grads, opt_state):
        """The lowered update (for HLO inspection: all-gather of params, sharded state)."""
        return self._update.lower(params, grads, opt_state,
                                  jax.ShapeDtypeStruct((), jnp.float32, sharding=self._replicated))


def zero1_adamw(schedule, mesh: Mesh, params, param_specs=None, weight_decay: float = 0.01,
                clip_norm: float = 1.0, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                donate: bool = False) -> Zero1Reference:
    """The ZeRO-1 sharded twin of `make_optimizer`: its AdamW (no local
    clipping) with clip-by-global-norm applied from the shared norm."""
    tx = make_optimizer(schedule, weight_decay=weight_decay, clip_norm=0, b1=b1, b2=b2, eps=eps)
    return Zero1Reference(tx, mesh, params, param_specs, clip_norm=clip_norm or None,
                          donate=donate)
