"""Async orbax checkpoints that verify on restore: train state + data state + checksums.

A checkpoint (`<dir>/<step>`, committed atomically by orbax) holds `state` (named arrays,
train/logical_state.py's plan-independent names, read straight into the shardings of the
new run's arrays of the same names), `data` (the data iterator's JSON state) and
`integrity` (per array its name, shape, dtype and two sharding-independent checksums; the
SHA-256 of the data state). `restore_latest` takes the newest checkpoint that restores and
verifies; one that does not is reported in one line and moved to `<dir>.unusable/<step>`.
Retention (`_prune`): the newest `keep`, every multiple of `keep_every` and the one this
run restored from. Multi-process saves and restores (stages held by some processes only,
checksums summed over processes): docs/design.md "Checkpoints".
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import sys
import time
import types
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from mmjax.errors import UserError, one_line
from mmjax.train.checkpoint_integrity import (all_processes, barrier,
                                              data_digest, global_checksums,
                                              integrity_record, is_named, named_arrays)
from mmjax.train.checkpoint_space import (SaveFailed, free_bytes, needed_bytes,
                                          save_failed_line, state_bytes, write_failure_reason)
from mmjax.train.startup_barrier import DEFAULT_TIMEOUT_S, meet_peers

class CheckpointUnusable(Exception):
    """This checkpoint cannot be restored faithfully (reason in the message)."""


class CheckpointMismatch(UserError):
    """The checkpoint is intact but was written for a different model or plan (bad input:
    the workdir belongs to another run)."""


def _widened(sharding):
    """Multi-process: `sharding` stretched so that every process holds a shard, or None
    when it does already. Orbax's multi-host save and restore need a shard of every array
    in every process, while a pipeline stage's arrays live in the processes of its mesh
    only. Each process without a device in the mesh adds a row of its own devices as
    replicas (replica_id > 0: never written, their reads discarded), so the stage's own
    shards keep their blocks, and replica 0 stays on the stage's devices."""
    if jax.process_count() == 1:
        return None
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        (dev,) = sharding.device_set
        sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([dev]), ("one",)),
                                              jax.sharding.PartitionSpec())
    if not isinstance(sharding, jax.sharding.NamedSharding):
        raise TypeError(f"checkpoint: unsupported sharding {type(sharding).__name__}")
    mesh = sharding.mesh
    held = {d.process_index for d in mesh.devices.flat}
    lacking = [p for p in range(jax.process_count()) if p not in held]
    if not lacking:
        return None
    rows = [mesh.devices]
    for p in lacking:
        own = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(own) < mesh.devices.size:
            raise ValueError(f"checkpoint: a {mesh.devices.size}-device stage mesh needs as "
                             f"many devices in process {p}, which has {len(own)}")
        rows.append(np.array(own[:mesh.devices.size], dtype=object).reshape(mesh.devices.shape))
    wide = jax.sharding.Mesh(np.stack(rows), ("checkpoint_copy",) + tuple(mesh.axis_names))
    return jax.sharding.NamedSharding(wide, sharding.spec)


def _widen(x, wide):
    """`x` on `wide`: its own shards where it has them, zeros on the added replicas."""
    mine = {s.device: s.data for s in x.addressable_shards}
    shape = wide.shard_shape(x.shape)
    parts = [mine[d] if d in mine else jax.device_put(np.zeros(shape, x.dtype), d)
             for d in wide.addressable_devices]
    return jax.make_array_from_single_device_arrays(x.shape, wide, parts, dtype=x.dtype)


def _narrow(x, sharding):
    """A restored widened array back on `sharding` (the added replicas dropped)."""
    keep = sharding.addressable_devices
    return jax.make_array_from_single_device_arrays(
        x.shape, sharding, [s.data for s in x.addressable_shards if s.device in keep],
        dtype=x.dtype)


def _handlers() -> dict:
    """Item handlers: arrays written by replica 0 only (orbax's replica-parallel writing
    would let the zero replicas of `_widened` write parts of a shard)."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()), (jax.Array, th.ArrayHandler(use_replica_parallel=False)))
    return {"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
            "data": ocp.JsonCheckpointHandler(), "integrity": ocp.JsonCheckpointHandler()}


class _QuietOrbaxErrors(logging.Filter):
    """Drops orbax's own error logs (a page of traceback each, several per failed save):
    every orbax failure reaches the Checkpointer as an exception and is reported from there
    in one line (SaveFailed, CheckpointUnusable)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if "/orbax/" in record.pathname.replace(os.sep, "/"):
            return False
        return not (record.name == "asyncio" and "orbax" in record.getMessage())


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


def checkpoint_steps(directory: str) -> list[int]:
    """Step directories (name = a step number), newest first; others are ignored."""
    if not os.path.isdir(directory):
        return []
    return sorted((int(n) for n in os.listdir(directory)
                   if n.isdigit() and os.path.isdir(os.path.join(directory, n))),
                  reverse=True)


class Checkpointer:
    def __init__(self, directory: str, keep: int = 3, keep_every: int | None = None,
                 async_save: bool = True, log=None, free_space=free_bytes,
                 startup_timeout: float = DEFAULT_TIMEOUT_S):
        """`free_space(directory)`: the bytes a save may use there (checked before each
        save; a filesystem's free space by default). `startup_timeout`: seconds the
        processes of a multi-process run wait for each other before orbax's first barrier
        (train/startup_barrier.py; StartupTimeout past it)."""
        if keep < 1:
            raise ValueError(f"train.keep_checkpoints={keep}: use >= 1")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"train.keep_every={keep_every}: use >= 1, or None for none")
        self.directory = os.path.abspath(directory)
        self.keep, self.keep_every = keep, keep_every
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.verified_step: int | None = None  # restored from this run: never deleted
        self.set_aside: list[int] = []  # steps found unusable by `restore_latest`
        self.unverified_data: int | None = None  # restored a format-1 step without one
        self.free_space = free_space
        self.pending: tuple | None = None  # (step, bytes needed) of the save in flight
        self.failed = False  # a save failed: nothing more is written or pruned
        self._quiet = _QuietOrbaxErrors()
        for name in ("absl", "asyncio"):
            logging.getLogger(name).addFilter(self._quiet)
        # the first barrier below is a collective (`sync_global_devices`, an all-gather:
        # gloo's 30 s rendezvous on CPU): the processes arrive together, through the
        # coordination service's barrier and our timeout
        meet_peers(f"checkpointer:{self.directory}", startup_timeout)
        self._remove_stray_temporaries()
        options = ocp.CheckpointManagerOptions(max_to_keep=None,
                                               enable_async_checkpointing=async_save,
                                               create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_handlers=_handlers())

    def _remove_stray_temporaries(self, quiet: bool = False, sync: bool = True) -> None:
        """A save killed mid-write (or failed) leaves orbax's temporary directory (`<step>.
        orbax-checkpoint-tmp-<time>`): never a checkpoint, removed (by process 0) before
        anything else here, and when a save fails."""
        if jax.process_index() == 0 and os.path.isdir(self.directory):
            for name in os.listdir(self.directory):
                if ".orbax-checkpoint-tmp" in name:
                    shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                    if not quiet:
                        self.log(f"removed {name}, the temporary directory of an "
                                 f"unfinished save, from {self.directory}")
        if sync:
            barrier("stray_temporaries")

    # ---- discovery -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        return checkpoint_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[0] if steps else None

    # ---- save ----------------------------------------------------------------------------
    def save(self, step: int, state, data_state: dict) -> None:
        """Start an async save of `state` (its leaves) and `data_state` at `step`; the
        previous save is finished (and old checkpoints pruned) first. Raises SaveFailed
        when this save or the previous one cannot be written (checkpoint_space.py)."""
        self.wait()
        self._prune()
        named = named_arrays(state)
        record = {**integrity_record(named), "data_sha256": data_digest(data_state)}
        need = needed_bytes(state_bytes(named.values()))
        free = self.free_space(self.directory)
        if not all_processes(free >= need):
            self._fail(step, "not enough free space" if free < need else
                       "not enough free space for another process's part", need, free)
        tree = {}
        for i, n in enumerate(sorted(named)):
            x = named[n]
            wide = _widened(x.sharding) if isinstance(x, jax.Array) else None
            tree[f"leaf_{i:05d}"] = x if wide is None else _widen(x, wide)
        self.pending = (step, need)
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(tree), data=ocp.args.JsonSave(data_state),
                integrity=ocp.args.JsonSave(record)), force=True)
        except Exception as e:  # noqa: BLE001 (the synchronous part of the write failed)
            self._fail(step, write_failure_reason(e), need, self.free_space(self.directory))

    def check(self) -> None:
        """Raise SaveFailed when the save in flight has failed (every process alike); call
        it between steps, so a failed write stops the run at once, not at the next save."""
        self._settle(self.manager.check_for_errors)

    def _settle(self, call) -> None:
        """Run orbax's `call`, which re-raises the writer's error: SaveFailed in every
        process when it failed in any."""
        error = None
        try:
            call()
        except Exception as e:  # noqa: BLE001 (orbax re-raises the writer's error)
            error = e
        if not all_processes(error is None):
            self._failed_in_flight(error)

    def _failed_in_flight(self, error) -> None:
        step, need = self.pending or (None, 0)
        reason = (write_failure_reason(error) if error is not None
                  else "the write failed in another process")
        self._fail(step, reason, need, self.free_space(self.directory))

    def _fail(self, step, reason: str, need: int, free: int) -> None:
        """The save of `step` is abandoned: its temporary directory removed, then SaveFailed."""
        self.failed, self.pending = True, None
        self._remove_stray_temporaries(quiet=True, sync=False)
        raise SaveFailed(save_failed_line(step, self.directory, reason, need, free))

    def _prune(self) -> None:
        barrier("prune")  # every process lists the same directories
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
                    self.manager.delete(s)  # every process (orbax syncs them)
                elif jax.process_index() == 0:
                    shutil.rmtree(os.path.join(self.directory, str(s)), ignore_errors=True)
            barrier("pruned")

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
        abstract: dict[str, Any] = {}
        wides: dict[str, Any] = {}
        for n, x in named.items():
            if not hasattr(x, "sharding"):
                abstract[stored[n][0]] = np.asarray(x)
                continue
            wides[n] = _widened(x.sharding)
            abstract[stored[n][0]] = jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=wides[n] or x.sharding)
        error = None
        try:
            with _quiet_abandoned_reads():
                out = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.PyTreeRestore(
                        abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(
                            abstract)), data=ocp.args.JsonRestore()))
            restored = {n: out["state"][stored[n][0]] for n in named}
            restored = {n: _narrow(x, named[n].sharding) if wides.get(n) is not None else x
                        for n, x in restored.items()}
            data = dict(out["data"])
        except Exception as e:  # noqa: BLE001 (tensorstore/orbax raise many types)
            error = f"cannot read arrays ({one_line(e, 160)})"
        digest = integrity.get("data_sha256")
        if error is None and digest is None and integrity.get("format", 1) >= 2:
            error = "the integrity record has no loader state checksum (edited or damaged)"
        elif error is None and digest not in (None, data_digest(data)):
            error = "loader state checksum mismatch (the data item was edited or damaged)"
        # each process reads its own shards: all of them agree before going on
        if not all_processes(error is None):
            raise CheckpointUnusable(error or "cannot read arrays (in another process)")
        names = sorted(restored)
        lacking = [n for n in names if not isinstance(stored[n][1].get("checksum"), list)]
        if lacking:
            raise CheckpointUnusable(f"the integrity record has no checksum for {lacking[0]}"
                                     f" (edited or damaged)")
        for n, (s, ws, _) in zip(names, global_checksums([restored[n] for n in names])):
            if [s, ws] != list(stored[n][1]["checksum"]):
                raise CheckpointUnusable(f"checksum mismatch in {n} "
                                         f"(shape {tuple(stored[n][1]['shape'])})")
        if digest is None:
            self.unverified_data = step
        if is_named(like):
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
        barrier("restore")  # every process sees the same steps
        for step in self.steps():
            try:
                state, data = self.restore(step, like)
            except CheckpointUnusable as e:
                self.set_aside.append(step)
                where = os.path.relpath(self._set_aside(step), os.path.dirname(self.directory))
                self.log(f"checkpoint step {step} in {self.directory} is unusable: {e}; "
                         f"moved to {where}, trying the next older one")
                continue
            self.verified_step = step
            if self.unverified_data == step:
                self.log(f"checkpoint step {step} in {self.directory} was written before "
                         f"loader states were checksummed: its arrays are verified, its "
                         f"loader state is not")
            return step, state, data
        return None

    def _set_aside(self, step: int) -> str:
        aside = self.directory.rstrip("/") + ".unusable"
        os.makedirs(aside, exist_ok=True)
        dest = os.path.join(aside, str(step))
        if os.path.exists(dest):  # the name process 0 picks (the others only report it)
            dest = f"{dest}-{int(time.time())}"
        if jax.process_index() == 0:
            os.replace(os.path.join(self.directory, str(step)), dest)
        barrier(f"set_aside_{step}")
        self.manager.reload()
        return dest

    def wait(self) -> None:
        """Wait for the save in flight; SaveFailed when it could not be written."""
        if self.failed:
            return
        self._settle(self.manager.wait_until_finished)
        self.pending = None

    def close(self) -> None:
        try:
            self.wait()
            if not self.failed:
                self._prune()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 (a failed save: already reported)
                if not self.failed:
                    raise
            for name in ("absl", "asyncio"):
                logging.getLogger(name).removeFilter(self._quiet)
