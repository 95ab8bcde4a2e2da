"""Run a stack of identical layers as one `jax.lax.scan` over their stacked weights.

XLA compiles a scan's body once, so a unit's compile time stays flat in its depth instead of
growing by a whole layer's forward and backward per layer (MaxText's `scan_layers`). The
layers stay separate modules (their own parameter names, per-layer init keys, pipeline
slices and Hugging Face names are unchanged); the stacking happens inside the traced
function, where XLA fuses it with the compute-dtype cast the weights go through anyway.

`remat` recomputes each layer in the backward (MaxText's `remat_policy` on the scanned
layer): "full" keeps only the layer's input, "dots" also the outputs of matmuls without
batch dimensions (the weight projections; the attention core is redone), "none" keeps all.

`layer_weights(fn)`: while a step is traced inside it, each layer's weights pass through
`fn(state, stacked=False)` inside the scan body (ZeRO-3: all-gathered just in time from
their shards, parallel/fsdp.py) and are never saved for the backward, which gathers them
again, so about one layer's full weights are live at a time; the stacked weights pass
through `fn(stacked_state, stacked=True)` before the scan (kept sharded, so the gather is
not hoisted out of the loop). The model code stays unaware of it. `unit_scope(name)`
tags the unit whose layers run inside it (`MultimodalModel.__call__` sets it per unit), so
such a function can place each unit's layers by that unit's rules (`current_unit()`).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mmjax.models.lora import dropout_active, layer_dropout

REMATS = ("none", "dots", "full")
_POLICY = {"full": jax.checkpoint_policies.nothing_saveable,
           "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


_LAYER_WEIGHTS: contextvars.ContextVar[Callable[..., Any] | None] = contextvars.ContextVar(
    "mmjax_layer_weights", default=None)
_GATHERED = "mmjax_layer_weights"
_UNIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("mmjax_layer_unit",
                                                                  default=None)


@contextlib.contextmanager
def layer_weights(fn):
    """Trace-time scope: every `run_stack` layer's state goes through `fn` in the scan body
    (None: unchanged), recomputed rather than saved for the backward."""
    token = _LAYER_WEIGHTS.set(fn)
    try:
        yield
    finally:
        _LAYER_WEIGHTS.reset(token)


@contextlib.contextmanager
def unit_scope(name: str):
    """Trace-time tag: the layers run inside belong to unit `name` (read by a
    `layer_weights` function through `current_unit`; nothing else changes)."""
    token = _UNIT.set(name)
    try:
        yield
    finally:
        _UNIT.reset(token)


def current_unit() -> str | None:
    """The unit `unit_scope` tagged, or None outside one."""
    return _UNIT.get()


def remat_policy(remat: str):
    """The `jax.checkpoint` policy of a unit's `remat` (None for "none")."""
    if remat not in REMATS:
        raise ValueError(f"remat={remat!r}: a unit's `remat` must be one of {list(REMATS)}")
    return _POLICY.get(remat)


def run_stack(layers, x, call, scan: bool = True, per_layer=None, remat: str = "none"):
    """`call(layers[-1], ... call(layers[0], x))`: `call(layer, x) -> x` with the same
    shape and dtype. With `scan` and two or more structurally identical layers, one
    `lax.scan` over the stacked layer states; otherwise a plain Python loop.

    `per_layer`: a NumPy array with one entry per layer (a decoder's local/global flags);
    `call(layer, x, flag)` then gets layer i's entry, a NumPy scalar in the loop (so the
    layer specialises on it) and a traced scalar carried through the scan.
    `remat`: each layer under `jax.checkpoint` with that policy, as a function of the
    layer's state (the module is merged inside, so no module crosses the checkpoint)."""
    layers = list(layers)
    policy = remat_policy(remat)
    gather = _LAYER_WEIGHTS.get()
    if gather is not None and policy is None:  # keep the matmul outputs, never a weight
        policy = _POLICY["dots"]  # (saving "anything" would keep w.T and reshaped weights)
    flags = None if per_layer is None else np.asarray(per_layer)
    if flags is not None and len(flags) != len(layers):
        raise ValueError(f"run_stack: {len(flags)} per-layer entries for {len(layers)} layers")

    def one(graphdef, state, h, flag, index):
        if gather is not None:
            state = jax.tree.map(lambda w: checkpoint_name(w, _GATHERED),
                                 gather(state, stacked=False))
        layer = nnx.merge(graphdef, state)
        with layer_dropout(index, _UNIT.get()):  # LoRA dropout's masks: per layer
            return call(layer, h) if flags is None else call(layer, h, flag)

    def step(graphdef, state, h, flag, index):
        # traced through the scan: arguments; static: closed over
        traced = {k: v for k, v in (("flag", flag), ("index", index))
                  if isinstance(v, jax.Array)}
        return jax.checkpoint(lambda s, hh, t: one(graphdef, s, hh, t.get("flag", flag),
                                                   t.get("index", index)),
                              policy=policy)(state, h, traced)

    if gather is not None:  # a loop would let XLA schedule every layer's gather at once
        scan = True
    if not scan or len(layers) < 2:
        return _loop(layers, x, call, flags, policy, step)
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    if any(g != graphdef for g, _ in splits[1:]):
        return _loop(layers, x, call, flags, policy, step)
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))
    if gather is not None:
        stacked = gather(stacked, stacked=True)
    # Equal entries stay static (the body specialises on them); only differing ones are traced.
    same = flags is None or bool((flags == flags[0]).all())
    index = jnp.arange(len(layers)) if dropout_active() else None  # a LoRA dropout step
    xs = (stacked, None if same else jnp.asarray(flags), index)

    def body(carry, xs):
        state, flag, i = xs
        flag = None if flags is None else flags[0] if same else flag
        if policy is None:
            return one(graphdef, state, carry, flag, i), None
        return step(graphdef, state, carry, flag, i), None

    x, _ = jax.lax.scan(body, x, xs)
    return x


def _loop(layers, x, call, flags, policy, step):
    for i, layer in enumerate(layers):
        flag = None if flags is None else flags[i]
        if policy is None:  # the modules themselves: no split / merge round trip
            with layer_dropout(i, _UNIT.get()):
                x = call(layer, x) if flags is None else call(layer, x, flag)
        else:
            graphdef, state = nnx.split(layer)
            x = step(graphdef, state, x, flag, i)
    return x
