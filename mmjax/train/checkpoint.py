"""Async orbax checkpoints that verify on restore: train state + data state + checksums.

A checkpoint (directory `<dir>/<step>`, committed atomically by orbax) holds three items:
`state` (named arrays, e.g. train/logical_state.py's plan-independent names, stored as
"leaf_00000", ... in name order and read straight into the shardings of the new run's arrays
of the same names), `data` (the data iterator's JSON state) and `integrity` (per array its
name, shape, dtype and two checksums of its logical value, independent of sharding). A
pytree that is not a {name: array} dict is saved by its flattened leaves ("0", "1", ...).

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

from mmjax.errors import one_line

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


def _is_named(state) -> bool:
    return isinstance(state, dict) and all(isinstance(k, str) and not isinstance(v, dict)
                                           for k, v in state.items())


def named_arrays(state) -> dict:
    """{name: array} as is; any other pytree by its flattened leaves, named "0", "1", ..."""
    if _is_named(state):
        return dict(state)
    return {str(i): x for i, x in enumerate(jax.tree.leaves(state))}


def integrity_record(named: dict) -> dict:
    """Per array (in name order, stored as leaf_00000, ...): name, shape, dtype, checksum.
    Refuses (NonFiniteState) a non-finite float: a checkpoint is only ever a state training
    could continue from."""
    out = {}
    for i, name in enumerate(sorted(named)):
        a = np.asarray(named[name])
        if jnp.issubdtype(a.dtype, jnp.inexact) and not np.isfinite(a).all():
            raise NonFiniteState(f"refusing to checkpoint a non-finite state ({name}, "
                                 f"{a.dtype}{a.shape})")
        out[f"leaf_{i:05d}"] = {"name": name, "shape": list(a.shape), "dtype": str(a.dtype),
                                "checksum": list(leaf_checksum(a))}
    return {"format": FORMAT, "leaves": out}


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
        named = named_arrays(state)
        tree = {f"leaf_{i:05d}": named[n] for i, n in enumerate(sorted(named))}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(tree), data=ocp.args.JsonSave(data_state),
            integrity=ocp.args.JsonSave(integrity_record(named))), force=True)

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
        """Restore `step` into the names (or leaves), shapes and shardings of `like` and
        verify every array; -> (state like `like`, data_state). Raises CheckpointUnusable
        (damaged) or CheckpointMismatch (intact, but another model's: a user error)."""
        path = os.path.join(self.directory, str(step))
        missing = [n for n in ("state", "data", "integrity")
                   if not os.path.isdir(os.path.join(path, n))]
        if missing:
            raise CheckpointUnusable(f"missing item(s) {', '.join(missing)}")
        try:
            integrity = self.manager.restore(step, args=ocp.args.Composite(
                integrity=ocp.args.JsonRestore()))["integrity"]
            stored = {e["name"]: (key, e) for key, e in integrity["leaves"].items()}
        except Exception as e:  # noqa: BLE001 (any failure to read means unusable)
            raise CheckpointUnusable(f"integrity record unreadable ({one_line(e, 160)})") from None
        named = named_arrays(like)
        self._check_structure(stored, named)
        abstract = {stored[n][0]: ocp.utils.to_shape_dtype_struct(x) if hasattr(x, "sharding")
                    else np.asarray(x) for n, x in named.items()}
        try:
            with _quiet_abandoned_reads():
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
            restored = {n: out["state"][stored[n][0]] for n in named}
            data = dict(out["data"])
        except Exception as e:  # noqa: BLE001 (tensorstore/orbax raise many types)
            raise CheckpointUnusable(f"cannot read arrays ({one_line(e, 160)})") from None
        for n, x in restored.items():
            if list(leaf_checksum(x)) != list(stored[n][1]["checksum"]):
                raise CheckpointUnusable(f"checksum mismatch in {n} "
                                         f"(shape {tuple(stored[n][1]['shape'])})")
        if _is_named(like):
            return restored, data
        return jax.tree.unflatten(jax.tree.structure(like),
                                  [restored[str(i)] for i in range(len(restored))]), data

    def _check_structure(self, stored: dict, named: dict) -> None:
        fix = ("written by another model or configuration (use another workdir, or the "
               "config that wrote them)")
        if set(stored) != set(named):
            extra, lack = sorted(set(stored) - set(named)), sorted(set(named) - set(stored))
            raise CheckpointMismatch(
                f"checkpoints in {self.directory} hold {len(stored)} arrays, this run has "
                f"{len(named)} (only in the checkpoint: {extra[:3]}, only in this run: "
                f"{lack[:3]}): {fix}")
        for n, x in named.items():
            e = stored[n][1]
            if tuple(e["shape"]) != tuple(np.shape(x)) or e["dtype"] != str(x.dtype):
                raise CheckpointMismatch(
                    f"checkpoints in {self.directory}: {n} is {e['dtype']}"
                    f"{tuple(e['shape'])}, this run's is {x.dtype}{tuple(np.shape(x))}: {fix}")

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
