"""A stage's forward and backward called on flat leaf lists (the runtime's dispatch path).

A stage's parameters and frozen weights are trees of `nnx` Variables, which JAX flattens
and unflattens in Python at every call of a jitted function (a few hundred node visits per
call). The runtime flattens each stage's parameters once per step (`Flat.of`), calls the
stage's programs on the leaves with the tree structures as static arguments, and keeps the
gradient accumulators flat until the stage's last backward of the step. The programs trace
the same functions on the same trees (`StageFns._forward_impl` / `_backward_impl`), so the
results are the tree path's, bit for bit (tests/test_flat_calls.py). The per-call records the
tree path keeps (input signature -> residual layout key, the abstract arguments for HLO
inspection) are made once per signature here.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mmjax.pipeline.residuals import Residuals, input_signature
from mmjax.pipeline.stage import StageFns, abstract_args
from mmjax.schedule.stage_graph import Backward


class Flat:
    """A tree as (leaves, treedef); `signature()` (treedef, leaf shapes and dtypes) made on
    first request."""

    __slots__ = ("leaves", "treedef", "_signature")

    def __init__(self, leaves: list, treedef):
        self.leaves, self.treedef = leaves, treedef
        self._signature: tuple | None = None

    @classmethod
    def of(cls, tree) -> "Flat":
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return cls(leaves, treedef)

    def tree(self):
        return self.treedef.unflatten(self.leaves)

    def signature(self) -> tuple:
        if self._signature is None:
            self._signature = (self.treedef, tuple(
                (tuple(a.shape), jnp.dtype(a.dtype).name) for a in self.leaves))
        return self._signature


class FlatCalls:
    """`forward(params, frozen, x, side) -> (y, Residuals)` and `backward(params, frozen,
    side, residuals, dy, acc) -> (acc leaves, dx)` of `fns` with `params`, `frozen`, `acc`
    as `Flat`s (acc's leaves donated); they record `fns.signatures` like the tree calls."""

    def __init__(self, fns: StageFns):
        self.fns = fns
        self._keys: dict[tuple, int] = {}  # (params, frozen, (x, side) signatures) -> key
        self._forward_sigs: dict[int, tuple] = {}
        self._backward_sigs: dict[int, tuple] = {}
        self._forward = jax.jit(self._forward_impl, static_argnames=("defs", "key"))
        self._backward = (None if fns.mode is Backward.NONE else
                          jax.jit(self._backward_impl, static_argnames=("defs",),
                                  donate_argnums=(5,)))

    def forward(self, params: Flat, frozen: Flat, x, side) -> tuple[Any, Residuals]:
        sig = (params.signature(), frozen.signature(), input_signature((x, side)))
        key = self._keys.get(sig)
        if key is None:  # first sight: the residual layout, as the tree call makes it
            args = (params.tree(), frozen.tree(), x, side)
            key = self._keys[sig] = self.fns.layout(*args)
            self._forward_sigs[key] = (abstract_args(args), key)
        self.fns.signatures["F"] = self._forward_sigs[key]
        return self._forward(params.leaves, frozen.leaves, x, side,
                             defs=(params.treedef, frozen.treedef), key=key)

    def backward(self, params: Flat, frozen: Flat, side, residuals: Residuals, dy,
                 acc: Flat) -> tuple[list, Any]:
        if self._backward is None:
            raise RuntimeError("internal: backward of a stage with no backward mode")
        sig = self._backward_sigs.get(residuals.key)
        if sig is None:
            sig = self._backward_sigs[residuals.key] = abstract_args(
                (params.tree(), frozen.tree(), side, residuals, dy, acc.tree()))
        self.fns.signatures["B"] = sig
        return self._backward(params.leaves, frozen.leaves, side, residuals, dy, acc.leaves,
                              defs=(params.treedef, frozen.treedef, acc.treedef))

    def _forward_impl(self, params, frozen, x, side, defs, key):
        return self.fns._forward_impl(defs[0].unflatten(params), defs[1].unflatten(frozen),
                                      x, side, key)

    def _backward_impl(self, params, frozen, side, residuals, dy, acc, defs):
        grads, dx = self.fns._backward_impl(defs[0].unflatten(params),
                                            defs[1].unflatten(frozen), side, residuals, dy,
                                            defs[2].unflatten(acc))
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        assert treedef == defs[2]  # the accumulators keep their structure
        return leaves, dx
