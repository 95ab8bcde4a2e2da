"""Run a stack of identical layers as one `jax.lax.scan` over their stacked weights.

XLA compiles a scan's body once, so a unit's compile time stays flat in its depth instead of
growing by a whole layer's forward and backward per layer (MaxText's `scan_layers`). The
layers stay separate modules (their own parameter names, per-layer init keys, pipeline
slices and Hugging Face names are unchanged); the stacking happens inside the traced
function, where XLA fuses it with the compute-dtype cast the weights go through anyway.
"""
from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx


def run_stack(layers, x, call, scan: bool = True, per_layer=None):
    """`call(layers[-1], ... call(layers[0], x))`: `call(layer, x) -> x` with the same
    shape and dtype. With `scan` and two or more structurally identical layers, one
    `lax.scan` over the stacked layer states; otherwise a plain Python loop.

    `per_layer`: a NumPy array with one entry per layer (a decoder's local/global flags);
    `call(layer, x, flag)` then gets layer i's entry, a NumPy scalar in the loop (so the
    layer specialises on it) and a traced scalar carried through the scan."""
    layers = list(layers)
    flags = None if per_layer is None else np.asarray(per_layer)
    if flags is not None and len(flags) != len(layers):
        raise ValueError(f"run_stack: {len(flags)} per-layer entries for {len(layers)} layers")
    if not scan or len(layers) < 2:
        return _loop(layers, x, call, flags)
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    if any(g != graphdef for g, _ in splits[1:]):
        return _loop(layers, x, call, flags)
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))
    # Equal entries stay static (the body specialises on them); only differing ones are traced.
    same = flags is None or bool((flags == flags[0]).all())
    xs = (stacked, None if same else jnp.asarray(flags))

    def body(carry, xs):
        state, flag = xs
        layer = nnx.merge(graphdef, state)
        if flags is None:
            return call(layer, carry), None
        return call(layer, carry, flags[0] if same else flag), None

    x, _ = jax.lax.scan(body, x, xs)
    return x


def _loop(layers, x, call, flags):
    for i, layer in enumerate(layers):
        x = call(layer, x) if flags is None else call(layer, x, flags[i])
    return x
