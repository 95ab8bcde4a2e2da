"""The ragged exchange's device side: one `lax.ragged_all_to_all` moving each device's rows to
their receivers (tables: parallel/ragged_tables.py), the GPU form of the rearrangement.

Per device inside `shard_map` over every mesh axis: gather the rows for other devices into
the send buffer (`take`), one ragged all-to-all (each link carries `send_sizes` real rows,
not the buffer), then gather the output slots from the pool [own input rows; receive
buffer] (`recv`). The VJP is the same exchange with the inverse map's tables
(`rearrange._exchange`), so the backward is one ragged all-to-all too.

XLA:CPU has no ragged all-to-all ("UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not
supported by XLA:CPU ThunkEmitter"): `exchange_kind` picks the staged exchange there, and
refuses "ragged" in one line. The program still lowers for CUDA from a CPU host
(`jit(...).trace(...).lower(lowering_platforms=("cuda",))`), which is how the tests read
its buffers (`hlo_traffic.ragged_operands`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mmjax.errors import UserError
from mmjax.parallel.ragged_tables import EXCHANGES


def exchange_kind(setting: str, backend: str | None = None) -> str:
    """The exchange `Loader.exchange` = `setting` runs on `backend` (default: JAX's):
    "auto" is "staged" everywhere until a GPU run has checked the ragged form against it
    (it is modelled and lowered for CUDA, never executed); "ragged" off GPU is a UserError."""
    backend = backend or jax.default_backend()
    if setting not in EXCHANGES:
        raise UserError(f"Loader.exchange={setting!r}: unknown (use one of {EXCHANGES})")
    if setting == "auto":
        return "staged"
    if setting == "ragged" and backend != "gpu":
        raise UserError(f"Loader.exchange='ragged' needs a GPU (XLA:{backend.upper()} has no "
                        f"ragged all-to-all; use Loader.exchange='staged' or 'auto')")
    return setting


def ragged_body(x, tables, *, axes, scope: str = ""):
    """Per device: x [src rows, ...] -> [dst rows, ...] (module docstring); the collective
    named `scope` (its op_name before the program is compiled)."""
    take, put = tables["take"][0], tables["recv"][0]
    recv_rows = tables["buffer"].shape[1]
    pool = x
    if take.shape[0] and recv_rows:
        buf = jnp.take(x, jnp.maximum(take, 0), axis=0)                # [send cap, ...]
        out = jnp.zeros((recv_rows,) + x.shape[1:], x.dtype)           # [receive cap, ...]
        with jax.named_scope(scope or "ragged_exchange"):
            got = lax.ragged_all_to_all(buf, out, tables["input_offsets"][0],
                                        tables["send_sizes"][0],
                                        tables["output_offsets"][0],
                                        tables["recv_sizes"][0], axis_name=axes)
        pool = jnp.concatenate([x, got], axis=0)
    out = jnp.take(pool, jnp.maximum(put, 0), axis=0)
    keep = (put >= 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(keep, out, jnp.zeros((), x.dtype))
