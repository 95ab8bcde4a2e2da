"""An entry of the program cache (train/program_cache.py) for a program JAX's persistent
cache answered, made from an earlier entry of the same compiled program (issue 41: after a
change to mmjax's source every program key is new, JAX's cache still answers the step,
and the executable it answered does not serialize whole on XLA:CPU: its kernels are
missing when run; without this every later run traced and lowered again).

Each stored entry is also named under its program's digest: the compiled HLO printed
without metadata (source lines change with any edit; large constants printed in full),
the executable's devices and the environment the program key holds (versions, backend,
JAX_* / XLA_* variables). A program JAX's cache answered with a digest already named is
stored under its new key as that earlier entry's executable bytes inside this
compilation's own metadata (argument and output trees, shardings): the same compiled
program, compiled in an earlier process. An entry stored before entries carried their
digest is named when it is loaded. A digest not named (the program was compiled with the
program cache off) stores nothing, as before."""
from __future__ import annotations

import hashlib
import importlib
import io
import os
import pickle

import jax


class _Executable:
    """An executable's serialized bytes, held unloaded while an entry is rewritten."""

    def __init__(self, data: bytes):
        self.data = data


class _Unpickler(pickle.Unpickler):
    """jax.experimental.serialize_executable's entries, executables left as bytes."""

    def __init__(self, file, backend):
        super().__init__(file)
        self.backend, self.devices = backend, {d.id: d for d in backend.devices()}
        self.executables: list[_Executable] = []

    def persistent_load(self, pid):
        if pid[0] == "exec":
            self.executables.append(_Executable(pid[1]))
            return self.executables[-1]
        if pid[0] == "device":
            return self.devices[pid[1]]
        if pid[0] == "client":
            return self.backend
        raise pickle.UnpicklingError(f"unknown persistent id {pid[0]!r}")


class _Pickler(pickle.Pickler):
    """The inverse of `_Unpickler`, each executable replaced by `data`."""

    def __init__(self, file, backend, data: bytes):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.backend_type, self.data = type(backend), data

    def persistent_id(self, obj):
        if isinstance(obj, _Executable):
            return ("exec", self.data)
        if isinstance(obj, jax.Device):
            return ("device", obj.id)
        if isinstance(obj, self.backend_type):
            return ("client",)
        return None


def _unpickled(payload: bytes, backend) -> tuple[object, bytes]:
    """(the entry's objects, its one executable's bytes)."""
    u = _Unpickler(io.BytesIO(payload), backend)
    obj = u.load()
    if len(u.executables) != 1:
        raise pickle.UnpicklingError(f"{len(u.executables)} executables in an entry")
    return obj, u.executables[0].data


def program_digest(compiled, environment: list[str]) -> str | None:
    """sha256 of `compiled`'s HLO without metadata, its devices and `environment`; None
    where this jaxlib cannot print it so."""
    try:
        options = importlib.import_module("jaxlib._hlo").HloPrintOptions()
        options.print_metadata, options.print_large_constants = False, True
        exe = compiled.runtime_executable()
        text = "".join(m.to_string(options) for m in exe.hlo_modules())
        devices = [d.id for d in exe.local_devices()]
    except (ImportError, AttributeError, TypeError):
        return None
    h = hashlib.sha256()
    for p in (*environment, str(devices), text):
        h.update(p.encode() + b"\0")
    return h.hexdigest()[:40]


def _name_path(cache_dir: str, digest: str) -> str:
    return os.path.join(cache_dir, f"mmjax-program-by-hlo-{digest}")


def name(cache_dir: str, digest: str | None, key: str) -> None:
    """Record that the entry `key` holds the program of `digest`."""
    if digest is None:
        return
    path = _name_path(cache_dir, digest)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(key)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)


def named(cache_dir: str, digest: str | None) -> str | None:
    """The key of the entry that holds the program of `digest`, or None."""
    if digest is None:
        return None
    try:
        with open(_name_path(cache_dir, digest)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def relinked(stored: tuple, fresh: tuple, backend) -> tuple:
    """An entry (payload, in_tree, out_tree) of `fresh` (serialized from the executable
    JAX's cache answered) holding `stored`'s executable bytes (an earlier entry of the
    same program)."""
    _, data = _unpickled(stored[0], backend)
    obj, _ = _unpickled(fresh[0], backend)
    with io.BytesIO() as f:
        _Pickler(f, backend, data).dump(obj)
        return f.getvalue(), fresh[1], fresh[2]
