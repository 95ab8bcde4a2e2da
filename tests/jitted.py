"""Call NNX modules in tests as whole jitted programs, never eagerly.

An eager tiny-LLM call dispatches ~200 single ops, each compiled alone (and, cold, written
to the persistent cache): seconds per call, against one program under `nnx.jit` that JAX
reuses for every module of the same structure and argument shapes. (Construction stays
eager: a tiny model's init ops are shared by every model in the process, while a jitted init
program per config compiles slower on CPU than those few ops.)
"""
from __future__ import annotations

from flax import nnx


@nnx.jit
def call(module, *args):
    """`module(*args)` as one jitted program (array arguments only)."""
    return module(*args)


@nnx.jit(static_argnums=0)
def method(name, module, *args):
    """`getattr(module, name)(*args)` as one jitted program (array arguments only)."""
    return getattr(module, name)(*args)
