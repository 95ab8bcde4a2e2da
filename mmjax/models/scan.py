"""Run a stack of identical layers as one `jax.lax.scan` over their stacked weights.

XLA compiles a scan's body once, so a unit's compile time stays flat in its depth instead of
growing by a whole layer's forward and backward per layer (MaxText's `scan_layers`). The
layers stay separate modules (their own parameter names, per-layer init keys, pipeline
slices and Hugging Face names are unchanged); the stacking happens inside the traced
function, where XLA fuses it with the compute-dtype cast the weights go through anyway.

`remat` recomputes each layer in the backward (MaxText's `remat_policy` on the scanned
layer): "full" keeps only the layer's input, "dots" also the outputs of matmuls without
batch dimensions (the weight projections; the attention core is redone), "none" keeps all.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


REMATS = ("none", "dots", "full")


_POLICY = {"full": jax.checkpoint_policies.nothing_saveable,
           "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def layer_remat(f, remat: str):
    """`f` under the per-layer recomputation policy `remat` (one of REMATS)."""
    if remat == "none":
        return f
    if remat in _POLICY:
        return jax.checkpoint(f, policy=_POLICY[remat], static_argnums=(0,))
    raise ValueError(f"remat={remat!r}: a unit's `remat` must be one of {list(REMATS)}")


def run_stack(layers, x, call, scan: bool = True, remat: str = "none"):
    """`call(layers[-1], ... call(layers[0], x))`: `call(layer, x) -> x` with the same
    shape and dtype. With `scan` and two or more structurally identical layers, one
    `lax.scan` over the stacked layer states; otherwise a plain Python loop. Each layer
    runs under `layer_remat(.., remat)` (a function of the layer's state, not the module)."""
    layers = list(layers)
    layer_remat(lambda: None, remat)  # the policy name checked even for an empty stack

    def run(graphdef, state, h):
        return call(nnx.merge(graphdef, state), h)
    run = layer_remat(run, remat) if remat != "none" else run
    splits = [nnx.split(layer) for layer in layers]
    same = all(g == splits[0][0] for g, _ in splits[1:])
    if not scan or len(layers) < 2 or not same:
        if remat == "none":  # the modules themselves: no split / merge round trip
            for layer in layers:
                x = call(layer, x)
            return x
        for graphdef, state in splits:
            x = run(graphdef, state, x)
        return x
    graphdef = splits[0][0]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *(s for _, s in splits))

    def body(carry, state):
        return run(graphdef, state, carry), None

    x, _ = jax.lax.scan(body, x, stacked)
    return x
