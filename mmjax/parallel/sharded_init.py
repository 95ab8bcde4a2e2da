"""Create a module's parameters with one jitted program, directly in their final sharding.

Built eagerly, every parameter is its own dispatched op and lands whole on the default
device before it is placed, so an 8B LLM stage would need its whole fp32 copy on one
device. Here `nnx.eval_shape` gives the structure, and one jitted program creates each
array as shards on its own mesh (XLA partitions the RNG: every device draws only its block,
the same values as an unsharded draw, JAX's partitionable threefry). The module is named
by a constructor and hashable arguments, static to `jax.jit`, so JAX reuses the compiled
init for every equal stage in a process, and the persistent compilation cache across runs.
Keys are the model's own (per-layer `fold_in`), so every plan initialises the same model.
"""
from __future__ import annotations

import contextlib
import functools

import jax
from flax import nnx
from jax._src import config as jax_config

from mmjax.parallel.tensor import state_shardings


def init_split(make_module, args: tuple, key, filters: tuple, mesh=None):
    """(graphdef, *states) of `nnx.split(make_module(*args, key), *filters)`, every state
    created by one jitted program. `make_module` and `args` must be hashable (a function and
    configs, names, layer numbers). `mesh`: each state gets its Megatron shardings on that
    mesh (parallel/tensor.py `state_shardings`); None: the default device."""
    graphdef = nnx.split(nnx.eval_shape(lambda: make_module(*args, key)), *filters)[0]
    return (graphdef, *init_states(make_module, args, key, filters, mesh))


def init_states(make_module, args: tuple, key, filters: tuple, mesh=None) -> tuple:
    """`init_split`'s states without its graphdef (which costs another abstract
    construction of the module: a caller that has one, train/single_program.py)."""
    with _fast_rng_compile(mesh):
        return tuple(_init_states(make_module, args, filters, mesh, key))


def lower_init_states(make_module, args: tuple, key, filters: tuple):
    """`init_states`' program on the default device, lowered (to compile, or to key a
    stored one by; it is then called on `key` alone)."""
    with _fast_rng_compile(None):
        return _init_states.lower(make_module, args, filters, None, key)


def _fast_rng_compile(mesh):
    """On one device, lower the init's threefry draws to JAX's GPU kernel: XLA:GPU inlines
    every draw's hash, and a 1.9B-parameter MLLM's init then had not compiled after 87 s on
    an H100, against 24 s with the kernel (README). Same bits (only the lowering of
    threefry2x32 changes; a no-op off GPU). Not under a mesh: a custom call does not
    partition, so every device would draw the whole array."""
    state = getattr(jax_config, "threefry_gpu_kernel_lowering", None)
    if mesh is not None or state is None:
        return contextlib.nullcontext()
    return state(True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _init_states(make_module, args, filters, mesh, key):
    states = nnx.split(make_module(*args, key), *filters)[1:]
    if mesh is not None:
        states = [jax.lax.with_sharding_constraint(s, state_shardings(s, mesh))
                  for s in states]
    return tuple(states)


def abstract_split(make_module, args: tuple, key, filters: tuple, mesh=None):
    """(graphdef, *states) of ShapeDtypeStructs carrying the shardings `init_split` would
    give on `mesh`: a stage whose mesh lies wholly in other processes (enough for
    `jax.eval_shape`); mesh None: shapes only."""
    graphdef, *abstract = nnx.split(nnx.eval_shape(lambda: make_module(*args, key)), *filters)
    if mesh is None:
        return (graphdef, *abstract)
    return (graphdef, *(jax.tree.map(
        lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), a,
        state_shardings(a, mesh)) for a in abstract))
