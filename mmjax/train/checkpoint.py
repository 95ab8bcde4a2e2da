"""Async orbax checkpoints that verify on restore: train state + data state + checksums.

A checkpoint (directory `<dir>/<step>`, committed atomically by orbax) holds three items:
`state` (the state pytree by flattened leaves "leaf_00000", ..., restored into the structure
and shardings of a freshly built state, so nnx.State and optax namedtuples round trip without
orbax knowing their types), `data` (the data iterator's JSON state) and `integrity` (per leaf
its shape, dtype and two checksums of its logical value, independent of how it is sharded).

`restore_latest` walks the checkpoints newest first and takes the first one that restores
and verifies. One that does not (an item missing, an array unreadable or truncated, a
checksum mismatch, an empty directory named like a step) is reported in one line and moved
to `<dir>.unusable/<step>` (kept for inspection, out of the way of the next save of that
step). Directories whose name is not a step number are ignored.

Retention (`_prune`, after each save commits): the newest `keep` checkpoints, every step
that is a multiple of `keep_every` (permanent) and the checkpoint this run restored from
(verified) are kept; older ones are deleted.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_M32 = (1 << 32) - 1
FORMAT = 1


class CheckpointUnusable(Exception):
    """This checkpoint cannot be restored faithfully (reason in the message)."""


class NonFiniteState(ValueError):
    """A state with NaN or inf is never written (it could not be trained on)."""


class CheckpointMismatch(ValueError):
    """The checkpoint is intact but was written for a different model or plan."""


def leaf_checksum(x) -> tuple[int, int]:
    """(sum, position-weighted sum) mod 2**32 of the element bit patterns (as unsigned ints
    of the element's width, 64-bit ones folded to 32): any single flipped bit changes the
    first, swapped elements change the second. Computed on the logical (gathered) value, so
    it does not depend on the sharding the array was saved or restored with."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    if a.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"leaf_checksum: unsupported dtype {a.dtype}")
    w = a.view(f"u{a.dtype.itemsize}").astype(np.uint64)
    if a.dtype.itemsize == 8:
        w = (w ^ (w >> np.uint64(32))) & np.uint64(_M32)
    idx = np.arange(1, a.size + 1, dtype=np.uint64)
    return int(w.sum(dtype=np.uint64)) & _M32, int((w * idx).sum(dtype=np.uint64)) & _M32


def integrity_record(leaves) -> dict:
    """Per leaf: shape, dtype, checksum. Refuses (NonFiniteState) a state with a non-finite
    float: a checkpoint is only ever a state training could continue from."""
    out = {}
    for i, x in enumerate(leaves):
        a = np.asarray(x)
        if jnp.issubdtype(a.dtype, jnp.inexact) and not np.isfinite(a).all():
            raise NonFiniteState(f"refusing to checkpoint a non-finite state (array {i}, "
                             f"{a.dtype}{a.shape})")
        out[f"leaf_{i:05d}"] = {"shape": list(a.shape), "dtype": str(a.dtype),
                                "checksum": list(leaf_checksum(a))}
    return {"format": FORMAT, "leaves": out}


def _one_line(e: BaseException, limit: int = 160) -> str:
    """The root cause of `e` (orbax wraps tensorstore's error) as one short line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


@contextlib.contextmanager
def _quiet_abandoned_reads():
    """A failed restore leaves orbax's other array-read coroutines failing too; Python
    reports each when it is collected ("Exception ignored in ...", a page of tensorstore
    spec). The restore error is reported in one line instead, so those are dropped."""
    default = sys.unraisablehook
    sys.unraisablehook = lambda u: None if u.exc_type is not None and isinstance(
        u.object, types.CoroutineType) else default(u)
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = default


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, keep_every: int | None = None,
                 async_save: bool = True, log=None):
        if keep < 1:
            raise ValueError(f"train.keep_checkpoints={keep}: use >= 1")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"train.keep_every={keep_every}: use >= 1, or None for none")
        self.directory = os.path.abspath(directory)
        self.keep, self.keep_every = keep, keep_every
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.verified_step: int | None = None  # restored from this run: never deleted
        options = ocp.CheckpointManagerOptions(max_to_keep=None,
                                               enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    # ---- discovery -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Step directories (name = a step number), newest first; others are ignored."""
        if not os.path.isdir(self.directory):
            return []
        return sorted((int(n) for n in os.listdir(self.directory)
                       if n.isdigit() and os.path.isdir(os.path.join(self.directory, n))),
                      reverse=True)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, state, data_state: dict) -> None:
        """Start an async save of `state` (its leaves) and `data_state` at `step`; the
        previous save is finished (and old checkpoints pruned) first."""
        self.manager.wait_until_finished()
        self._prune()
        leaves = jax.tree.leaves(state)
        tree = {f"leaf_{i:05d}": leaf for i, leaf in enumerate(leaves)}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), data=ocp.args.JsonSave(data_state),
            integrity=ocp.args.JsonSave(integrity_record(leaves))), force=True)

    def _prune(self) -> None:
        steps = self.steps()
        keep = set(steps[:self.keep])
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        if self.verified_step is not None:
            keep.add(self.verified_step)
        gone = [s for s in steps if s not in keep]
        if gone:
            self.manager.reload()
            for s in gone:
                if s in self.manager.all_steps():
                    self.manager.delete(s)
                else:
                    shutil.rmtree(os.path.join(self.directory, str(s)), ignore_errors=True)

    # ---- restore -------------------------------------------------------------------------
    def restore(self, step: int, like):
        """Restore `step` into the structure (and shardings) of `like` and verify every
        leaf; -> (state, data_state). Raises CheckpointUnusable (damaged) or
        CheckpointMismatch (intact, but another model's: a user error)."""
        path = os.path.join(self.directory, str(step))
        missing = [n for n in ("state", "data", "integrity")
                   if not os.path.isdir(os.path.join(path, n))]
        if missing:
            raise CheckpointUnusable(f"missing item(s) {', '.join(missing)}")
        leaves, treedef = jax.tree.flatten(like)
        try:
            integrity = self.manager.restore(step, args=ocp.args.Composite(
                integrity=ocp.args.JsonRestore()))["integrity"]
        except Exception as e:  # noqa: BLE001 (any failure to read means unusable)
            raise CheckpointUnusable(f"integrity record unreadable ({_one_line(e)})") from None
        expected = integrity.get("leaves", {}) if isinstance(integrity, dict) else {}
        self._check_structure(expected, leaves)
        abstract = {f"leaf_{i:05d}": ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "sharding")
                    else np.asarray(x) for i, x in enumerate(leaves)}
        try:
            with _quiet_abandoned_reads():
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            restored = [out["state"][f"leaf_{i:05d}"] for i in range(len(leaves))]
            data = dict(out["data"])
        except Exception as e:  # noqa: BLE001 (tensorstore/orbax raise many types)
            raise CheckpointUnusable(f"cannot read arrays ({_one_line(e)})") from None
        for i, x in enumerate(restored):
            name = f"leaf_{i:05d}"
            if list(leaf_checksum(x)) != list(expected[name]["checksum"]):
                raise CheckpointUnusable(f"checksum mismatch in {name} "
                                         f"(shape {tuple(expected[name]['shape'])})")
        return jax.tree.unflatten(treedef, restored), data

    def _check_structure(self, expected: dict, leaves) -> None:
        if len(expected) != len(leaves):
            raise CheckpointMismatch(
                f"checkpoints in {self.directory} hold {len(expected)} arrays, this run's "
                f"state has {len(leaves)}: they were written by another model or plan "
                f"(use another workdir, or the config that wrote them)")
        for i, x in enumerate(leaves):
            e = expected[f"leaf_{i:05d}"]
            if tuple(e["shape"]) != tuple(np.shape(x)) or e["dtype"] != str(x.dtype):
                raise CheckpointMismatch(
                    f"checkpoints in {self.directory}: array {i} is {e['dtype']}"
                    f"{tuple(e['shape'])}, this run's is {x.dtype}{tuple(np.shape(x))}: "
                    f"written by another model or plan (use another workdir, or the config "
                    f"that wrote them)")

    def restore_latest(self, like):
        """-> (step, state, data_state) of the newest checkpoint that verifies, or None.
        Unusable ones on the way are named in one line each and set aside."""
        for step in self.steps():
            try:
                state, data = self.restore(step, like)
            except CheckpointUnusable as e:
                where = os.path.relpath(self._set_aside(step), os.path.dirname(self.directory))
                self.log(f"checkpoint step {step} in {self.directory} is unusable: {e}; "
                         f"moved to {where}, trying the next older one")
                continue
            self.verified_step = step
            return step, state, data
        return None

    def _set_aside(self, step: int) -> str:
        aside = self.directory.rstrip("/") + ".unusable"
        os.makedirs(aside, exist_ok=True)
        dest = os.path.join(aside, str(step))
        if os.path.exists(dest):
            dest = f"{dest}-{int(time.time())}"
        os.replace(os.path.join(self.directory, str(step)), dest)
        self.manager.reload()
        return dest

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self._prune()
        self.manager.close()
