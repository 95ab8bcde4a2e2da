"""The same program in float64: the reference that float32 results are judged against.

`in_float64(fn)(*args)` traces `fn` once (with the arguments' own float32 types), then
evaluates its jaxpr with every float32 value, constant and dtype parameter (a cast's target,
a dot's accumulation type, an iota's type) promoted to float64, under `jax.enable_x64`
(random bits bitcast to float32 as in the program, then widened exactly: dropout masks are
the program's own). The model code is untouched: its explicit `astype(jnp.float32)` become float64 casts, so the result is
the float32 program's mathematics rounded at float64 (~1e-16), not a second implementation.

Calls (`jit`, remat, custom derivatives, already resolved by tracing `value_and_grad`) are
inlined; loops and branches (`scan`, `while`, `cond`) keep their structure with promoted
bodies; a scatter's combiner is promoted like a body.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jc

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
_INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
           "core_call": "call_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
           "custom_vjp_call_jaxpr": "fun_jaxpr"}
_LOOPS = {"scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",)}


def _promote_dtype(v):
    return F64 if isinstance(v, np.dtype) and v == F32 else v


def _promote_value(x):
    if isinstance(getattr(x, "dtype", None), np.dtype) and x.dtype == F32:  # not PRNG keys
        return jnp.asarray(x, F64)
    return x


def _promote_aval(aval):
    if isinstance(aval, jax.core.ShapedArray) and isinstance(aval.dtype, np.dtype) \
            and aval.dtype == F32:
        return jax.ShapeDtypeStruct(aval.shape, F64)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _promote_closed(closed: jc.ClosedJaxpr) -> jc.ClosedJaxpr:
    """A loop body or branch with its inputs, constants and arithmetic in float64."""
    avals = [_promote_aval(v.aval) for v in closed.jaxpr.invars]
    return jax.make_jaxpr(lambda *a: _eval(closed.jaxpr, closed.consts, a))(*avals)


def _promote_open(jaxpr: jc.Jaxpr) -> jc.Jaxpr:
    """A constant-free jaxpr parameter (a scatter's combiner) in float64."""
    closed = _promote_closed(jc.ClosedJaxpr(jaxpr, []))
    assert not closed.consts, "a promoted combiner gained constants"
    return closed.jaxpr


def _eval(jaxpr: jc.Jaxpr, consts, args):
    env = {}
    read = lambda v: _promote_value(v.val) if isinstance(v, jc.Literal) else env[v]

    def write(vs, xs):
        for v, x in zip(vs, xs):
            if not isinstance(v, jc.DropVar):
                env[v] = x

    write(jaxpr.constvars, [_promote_value(c) for c in consts])
    write(jaxpr.invars, [_promote_value(a) for a in args])
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, dict(eqn.params)
        ins = [read(v) for v in eqn.invars]
        if name in _INLINE:
            inner = params[_INLINE[name]]
            if isinstance(inner, jc.ClosedJaxpr):
                outs = _eval(inner.jaxpr, inner.consts, ins)
            else:
                outs = _eval(inner, [], ins)
        elif name in _LOOPS:
            for key in _LOOPS[name]:
                p = params[key]
                params[key] = (tuple(_promote_closed(b) for b in p) if isinstance(p, tuple)
                               else _promote_closed(p))
            outs = eqn.primitive.bind(*ins, **params)
        else:  # a scatter's or reduce's combiner is a scalar jaxpr: promoted like a body
            params = {k: _promote_open(p) if isinstance(p, jc.Jaxpr) else
                      _promote_closed(p) if isinstance(p, jc.ClosedJaxpr) else p
                      for k, p in params.items()}
            if name == "bitcast_convert_type":  # random bits -> float32, then exactly f64
                outs = _promote_value(eqn.primitive.bind(*ins, **params))
            else:
                params = {k: _promote_dtype(p) for k, p in params.items()}
                outs = eqn.primitive.bind(*ins, **params)
        write(eqn.outvars, outs if eqn.primitive.multiple_results else [outs])
    return [read(v) for v in jaxpr.outvars]


def in_float64(fn):
    """`fn` evaluated in float64: returns a function of the same arguments giving the same
    pytree of outputs, every float as a float64 NumPy array."""
    def run(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat_args = jax.tree.leaves(args)
        with jax.enable_x64(True):
            flat = jax.jit(lambda *a: _eval(closed.jaxpr, closed.consts, a))(*flat_args)
            flat = [np.asarray(x) for x in flat]
        return jax.tree.unflatten(jax.tree.structure(out_shape), flat)
    return run
