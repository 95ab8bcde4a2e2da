"""Run a stack of identical layers as one `jax.lax.scan` over their stacked weights.

XLA compiles a scan's body once, so a unit's compile time stays flat in its depth instead of
growing by a whole layer's forward and backward per layer (MaxText's `scan_layers`). The
layers stay separate modules (their own parameter names, per-layer init keys, pipeline
slices and Hugging Face names are unchanged); the stacking happens inside the traced
function, where XLA fuses it with the compute-dtype cast the weights go through anyway.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def run_stack(layers, x, call, scan: bool = True):
    """`call(layers[-1], ... call(layers[0], x))`: `call(layer, x) -> x` with the same
    shape and dtype. With `scan` and two or more structurally identical layers, one
    `lax.scan` over the stacked layer states; otherwise a plain Python loop."""
    layers = list(layers)
    if not scan or len(layers) < 2:
        for layer in layers:
            x = call(layer, x)
        return x
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    if any(g != graphdef for g, _ in splits[1:]):
        for layer in layers:
            x = call(layer, x)
        return x
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))

    def body(carry, state):
        return call(nnx.merge(graphdef, state), carry), None

    x, _ = jax.lax.scan(body, x, stacked)
    return x
