"""What makes a checkpoint verifiable (train/checkpoint.py writes and checks it): per array
two sharding-independent checksums of its element bits, summed over the processes' own
shards without gathering; a refusal to record a non-finite state; the SHA-256 of the data
iterator's state; the all-process decisions restore takes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_M32 = (1 << 32) - 1
# 2: every checkpoint carries the loader state's SHA-256 and every array's checksum, and
# one that lacks either is unusable; format 1 (before) may lack the loader's: restored, and
# named once as unverified
FORMAT = 2


class NonFiniteState(ValueError):
    """A state with NaN or inf is never written (it could not be trained on)."""


def leaf_checksum(x) -> tuple[int, int]:
    """(sum, position-weighted sum) mod 2**32 of the element bit patterns (as unsigned ints
    of the element's width, 64-bit ones folded to 32): any single flipped bit changes the
    first, swapped elements change the second. Computed on the logical (gathered) value, so
    it does not depend on the sharding the array was saved or restored with."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    w = _bits(a)
    idx = np.arange(1, a.size + 1, dtype=np.uint64)
    return int(w.sum(dtype=np.uint64)) & _M32, int((w * idx).sum(dtype=np.uint64)) & _M32


def is_named(state) -> bool:
    return isinstance(state, dict) and all(isinstance(k, str) and not isinstance(v, dict)
                                           for k, v in state.items())


def named_arrays(state) -> dict:
    """{name: array} as is; any other pytree by its flattened leaves, named "0", "1", ..."""
    if is_named(state):
        return dict(state)
    return {str(i): x for i, x in enumerate(jax.tree.leaves(state))}


def _bits(a: np.ndarray) -> np.ndarray:
    """Element bit patterns as uint64 (64-bit ones folded to 32), as `leaf_checksum`."""
    if a.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"leaf_checksum: unsupported dtype {a.dtype}")
    w = np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}").astype(np.uint64)
    if a.dtype.itemsize == 8:
        w = (w ^ (w >> np.uint64(32))) & np.uint64(_M32)
    return w


def _nonfinite(a: np.ndarray) -> int:
    return int(jnp.issubdtype(a.dtype, jnp.inexact) and not np.isfinite(a).all())


def partial_checksum(x) -> tuple[int, int, int]:
    """(sum, weighted sum, non-finite) of `leaf_checksum` over the elements this process
    owns: the shards with replica_id 0 among its addressable ones, positions taken in the
    global array. Both sums are additive over elements, so adding every process's parts
    (mod 2**32) gives `leaf_checksum` of the whole array without gathering it. A host
    value (not a jax.Array) is counted by process 0."""
    if not isinstance(x, jax.Array):
        if jax.process_index():
            return 0, 0, 0
        a = np.asarray(x)
        return (*leaf_checksum(a), _nonfinite(a))
    shape = tuple(x.shape)
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    s = ws = bad = 0
    for sh in x.addressable_shards:
        if sh.replica_id:
            continue
        a = np.asarray(sh.data)
        w = _bits(a)
        pos = np.ones(a.shape, np.uint64)
        for d, sl in enumerate(sh.index):
            start = sl.start or 0
            ax = (np.arange(a.shape[d], dtype=np.uint64) + np.uint64(start)) * np.uint64(strides[d])
            pos = pos + ax.reshape((-1,) + (1,) * (a.ndim - d - 1))
        s += int(w.sum(dtype=np.uint64))
        ws += int((w * pos).sum(dtype=np.uint64))
        bad |= _nonfinite(a)
    return s & _M32, ws & _M32, bad


def global_checksums(arrays: list) -> list[tuple[int, int, bool]]:
    """Per array: its `leaf_checksum` and whether it holds a non-finite value, computed
    from each process's own shards and summed across processes (one small all-gather)."""
    parts: np.ndarray = np.array([partial_checksum(x) for x in arrays], np.uint32).reshape(-1, 3)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        parts = np.asarray(multihost_utils.process_allgather(parts)).reshape(
            -1, len(arrays), 3)
    else:
        parts = parts[None]
    total = parts.astype(np.uint64).sum(axis=0)
    return [(int(a) & _M32, int(b) & _M32, bool(c)) for a, b, c in total]


def all_processes(ok: bool) -> bool:
    """True when `ok` on every process (a decision every process must take alike)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.asarray(multihost_utils.process_allgather(np.array([int(ok)], np.int32))).all())


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        ocp.multihost.sync_global_processes(f"mmjax_checkpoint_{name}")


def integrity_record(named: dict) -> dict:
    """Per array (in name order, stored as leaf_00000, ...): name, shape, dtype, checksum.
    Refuses (NonFiniteState) a non-finite float: a checkpoint is only ever a state training
    could continue from. Multi-process: every process gets the same record."""
    names = sorted(named)
    sums = global_checksums([named[n] for n in names])
    out = {}
    for i, (name, (s, ws, bad)) in enumerate(zip(names, sums)):
        x = named[name]
        if bad:
            raise NonFiniteState(f"refusing to checkpoint a non-finite state ({name}, "
                                 f"{np.dtype(x.dtype)}{tuple(np.shape(x))})")
        out[f"leaf_{i:05d}"] = {"name": name, "shape": list(np.shape(x)),
                                "dtype": str(np.dtype(x.dtype)), "checksum": [s, ws]}
    return {"format": FORMAT, "leaves": out}


def data_digest(data_state: dict) -> str:
    """SHA-256 of the data iterator's JSON state (canonical: sorted keys), so an edited
    `next_batch` or skip count is caught like a flipped parameter bit. Checkpoints written
    before it was recorded have none and are read as they are."""
    import hashlib
    import json

    text = json.dumps(data_state, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()
