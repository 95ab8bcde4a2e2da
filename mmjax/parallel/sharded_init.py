"""Create a module's parameters with one jitted program, directly in their final sharding.

Built eagerly, every parameter is its own dispatched op (a compile per new shape: 6.7 s of
the tiny model's start-up) and lands whole on the default device before it is placed, so
an 8B LLM stage would need its whole fp32 copy on one device. Here `nnx.eval_shape` gives
the structure, and one `jax.jit` with `out_shardings` creates each array as shards on its
own mesh (XLA partitions the RNG: every device draws only its block, the same values as an
unsharded draw, JAX's partitionable threefry). The program lands in the persistent
compilation cache, so a resume does not pay it again. Keys are the model's own (per-layer
`fold_in`), so every plan still initialises the same model.
"""
from __future__ import annotations

import jax
from flax import nnx

from mmjax.parallel.tensor import state_shardings


def init_split(build, filters: tuple, mesh=None):
    """(graphdef, *states): `nnx.split(build(), *filters)` with every state created by one
    jitted program. `mesh`: place each state with its Megatron shardings on that mesh
    (parallel/tensor.py `state_shardings`); None: on the default device."""
    graphdef, *abstract = nnx.split(nnx.eval_shape(build), *filters)
    shardings = None if mesh is None else tuple(state_shardings(a, mesh) for a in abstract)

    def make():
        return tuple(nnx.split(build(), *filters)[1:])

    return (graphdef, *jax.jit(make, out_shardings=shardings)())


def abstract_split(build, filters: tuple, mesh):
    """(graphdef, *states) of ShapeDtypeStructs carrying the shardings `init_split` would
    give: a stage whose mesh lies wholly in other processes (enough for `jax.eval_shape`)."""
    graphdef, *abstract = nnx.split(nnx.eval_shape(build), *filters)
    return (graphdef, *(jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), a,
        state_shardings(a, mesh)) for a in abstract))
