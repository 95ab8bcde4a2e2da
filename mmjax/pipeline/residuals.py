"""Stage residuals: which `jax.vjp` residuals a stage keeps per in-flight microbatch under
its remat policy (`remat_wrap`), and which are functions of the parameters alone or host
inputs, dropped and recomputed in backward (`residual_layout`, a dependence analysis of the
traced jaxpr). The long story: docs/design.md "Stage residuals"."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.planner.plan import REMAT_POLICIES


# Primitives whose single sub-jaxpr maps the eqn's inputs/outputs one to one, so dependence
# can be traced through them exactly; any other higher-order primitive (scan, while, cond)
# is treated conservatively (every output depends on every input).
_CALL_LIKE = ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint", "shard_map",
              "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call")


def _weight_dots_saveable(rank_dims: int):
    """Checkpoint policy: save a dot_general with at most `rank_dims` batch dimensions. The
    stage vmaps over its dp ranks, each on its own parameter copy (`StageFns._block`), so
    inside that vmap every weight matmul carries one batch dimension (the rank) and JAX's
    `dots_with_no_batch_dims_saveable` would save nothing; the attention core (q.k, p.v:
    batch, heads and the rank) stays above the bound either way."""
    def policy(prim, *_, **params):
        if prim.name != "dot_general":
            return False
        (_, _), (lhs_batch, _) = params["dimension_numbers"]
        return len(lhs_batch) <= rank_dims
    return policy


def remat_wrap(f, remat: str, rank_dims: int = 0):
    """The stage function under the plan's remat policy (`rank_dims`: 1 when `f` runs its
    dp ranks under a vmap, see `_weight_dots_saveable`).

    "full": `nothing_saveable`, per microbatch only the stage's inputs are kept and backward
    re-runs the forward (Megatron full recomputation). "dots": `_weight_dots_saveable` keeps
    the outputs of the weight matmuls (projections, FFN, logits: dot_generals without batch
    dimensions beyond the dp rank) and recomputes the rest: the elementwise work, norms and the attention
    core (q.k and p.v are batched dot_generals, quadratic in the sequence and cheap to redo
    relative to their memory), i.e. Megatron's selective recomputation (Korthikanti et al.).
    `dots_saveable` would also keep the [B, H, S, S] attention scores, the largest activation
    of long sequences. "none": no checkpoint, every residual is kept.
    """
    if remat == "full":
        return jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    if remat == "dots":
        return jax.checkpoint(f, policy=_weight_dots_saveable(rank_dims))
    if remat == "none":
        return f
    raise ValueError(f"remat={remat!r}: must be one of {REMAT_POLICIES}")


def _sub_jaxprs(params) -> list:
    """The (open) jaxprs among an eqn's params, looking one level into tuples/lists; built
    on the public `Jaxpr`/`ClosedJaxpr` types only, so it holds across jax versions."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    out = []
    for v in params.values():
        for item in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(item, ClosedJaxpr):
                out.append(item.jaxpr)
            elif isinstance(item, Jaxpr):
                out.append(item)
    return out


def _depends(jaxpr, in_dep) -> list[bool]:
    """Per outvar of `jaxpr`: does it depend on an invar flagged in `in_dep`?"""
    from jax.extend.core import Literal

    dep = {v for v, d in zip(jaxpr.invars, in_dep) if d}
    for eqn in jaxpr.eqns:
        ins = [not isinstance(v, Literal) and v in dep for v in eqn.invars]
        if not any(ins):
            continue
        subs = _sub_jaxprs(eqn.params)
        if (eqn.primitive.name in _CALL_LIKE and len(subs) == 1
                and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars)):
            outs = _depends(subs[0], ins)
        else:
            outs = [True] * len(eqn.outvars)
        dep.update(v for v, d in zip(eqn.outvars, outs) if d)
    return [not isinstance(v, Literal) and v in dep for v in jaxpr.outvars]


@jax.tree_util.register_pytree_node_class
class Residuals:
    """What one microbatch's forward keeps for its backward: the leaves of the `jax.vjp`
    function that depend on the stage input or the host inputs. `key` (static) names the
    traced signature in `StageFns.layouts`."""

    def __init__(self, leaves, key: int):
        self.leaves, self.key = list(leaves), key

    def tree_flatten(self):
        return (self.leaves,), self.key

    @classmethod
    def tree_unflatten(cls, key, children):
        return cls(children[0], key)

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.leaves)


@dataclass(frozen=True)
class ResidualLayout:
    """Per traced input signature: which vjp leaves backward rebuilds instead of receiving
    (`recompute`: functions of the parameters alone, the parameters themselves included;
    `side`: leaf -> index of the host input it is), and the stage input's shapes."""

    num_leaves: int
    recompute: frozenset
    side: dict
    x_shapes: object


def input_signature(tree):
    """(treedef, leaf shapes and dtypes) of `tree`: the key of a jitted stage input."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in leaves)


def residual_layout(linearize, args) -> ResidualLayout:
    """Which vjp leaves of `linearize(*args)` are functions of the parameters alone
    (dependence analysis of the traced jaxpr) or are host inputs; traced on shapes only.
    `args` = (trainable, frozen, x, side)."""
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype), args)
    counts = {}

    def probe(*xs):
        y, leaves, _ = linearize(*xs)
        counts["res"] = len(leaves)
        return y, leaves

    closed = jax.make_jaxpr(probe)(*abstract)
    trainable, frozen, x, side = abstract
    n_params = len(jax.tree.leaves((trainable, frozen)))
    n_x, n_side = len(jax.tree.leaves(x)), len(jax.tree.leaves(side))
    outs = closed.jaxpr.outvars
    dep = _depends(closed.jaxpr, [False] * n_params + [True] * (n_x + n_side))
    n_y = len(outs) - counts["res"]
    side_vars = closed.jaxpr.invars[n_params + n_x:]
    side_pos, recompute = {}, set()
    for i, (v, d) in enumerate(zip(outs[n_y:], dep[n_y:])):
        hit = [j for j, sv in enumerate(side_vars) if v is sv]
        if hit:
            side_pos[i] = hit[0]
        elif not d:
            recompute.add(i)
    return ResidualLayout(counts["res"], frozenset(recompute), side_pos, x)
