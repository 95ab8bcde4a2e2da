"""Compiled training steps (and the single program's init) stored on disk by what they are
made from, so a warm run skips tracing and lowering, not only XLA (issue 41: a second
run's start within 10% of the first's compile; train/program_prefetch.py loads them while
the run starts).

JAX's persistent compilation cache is keyed by the lowered program, so every run still
traces and lowers the step (12-18 s of the tiny model's warm start on 2 cores) before the
cache can answer. Here the key is everything the program is a function of, known before
tracing: the versions of jax / jaxlib / flax / optax, the backend and its devices, the
JAX_* / XLA_* environment, a digest of mmjax's own source files, the gin bindings (less
`train.steps`: the learning rate is a step input, so the step does not depend on it), and
the caller's description of the model, settings and the abstract inputs (shapes, dtypes,
placement). A change in any of them is another key: a miss, never a wrong program. The
entry is JAX's serialized executable (`jax.experimental.serialize_executable`) and its
argument trees, a file `mmjax-program-<key>.pkl` beside JAX's own entries (off with the
cache); an entry whose argument tree differs is not used. A program JAX's cache answered
does not serialize whole on XLA:CPU (its kernels are missing when run), so `compiling`
tells the two apart, and such a program is stored from an earlier entry of the same
compiled program (train/program_relink.py: after a source change, say)."""
from __future__ import annotations

import hashlib
import os
import pickle
import re
import threading
from contextlib import contextmanager

import jax

from mmjax.train import program_relink

_STEPS = re.compile(r"^train\.steps\s*=.*$", re.MULTILINE)


def _versions() -> list[str]:
    """The versions of the packages a compiled step is made by (their own `__version__`:
    importlib.metadata would list site-packages, ~0.2 s of a warm start)."""
    import flax
    import jaxlib
    import optax

    return [f"{m.__name__}={getattr(m, '__version__', '?')}"
            for m in (jax, jaxlib, flax, optax)]


def environment() -> list[str]:
    """What every program of this process is compiled under: versions, backend and its
    devices, the JAX_* / XLA_* environment."""
    dev = jax.local_devices()[0]
    env = sorted(f"{k}={v}" for k, v in os.environ.items()
                 if k.startswith(("JAX_", "XLA_")) and k != "JAX_COMPILATION_CACHE_DIR")
    return [*_versions(), dev.platform, dev.device_kind, str(jax.local_device_count()),
            getattr(dev.client, "platform_version", ""), *env]


def source_digest() -> str:
    """sha256 of mmjax's .py files (relative paths and bytes, in sorted order)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    files = []
    for d, _, names in os.walk(root):
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    for path in sorted(files):
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def gin_bindings() -> str:
    """The run's gin bindings without `train.steps` (programs do not depend on it)."""
    import gin

    text = _STEPS.sub("", gin.config_str())
    return "\n".join(line for line in text.splitlines()
                     if line.strip() and not line.lstrip().startswith("#"))


def program_key(*parts: str) -> str:
    """The key of a program made from `parts` (the caller's description) in this process:
    versions, backend, environment, mmjax's source and the gin bindings added."""
    fixed = [*environment(), source_digest(), gin_bindings()]
    h = hashlib.sha256()
    for p in (*fixed, *parts):
        h.update(str(p).encode() + b"\0")
    return h.hexdigest()[:40]


_HIT = "/jax/compilation_cache/cache_hits"


@contextmanager
def compiling():
    """A list that holds an entry once a compilation on this thread inside the block was
    answered by JAX's persistent cache (JAX's monitoring event; other threads' ignored)."""
    me, hits = threading.get_ident(), []

    def on_event(event: str, **_):
        if event == _HIT and threading.get_ident() == me:
            hits.append(event)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(on_event)


def _path(cache_dir: str, key: str) -> str:
    return os.path.join(cache_dir, f"mmjax-program-{key}.pkl")


def _read(cache_dir: str, key: str) -> tuple | None:
    try:
        with open(_path(cache_dir, key), "rb") as f:
            entry = pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None
    return entry if isinstance(entry, tuple) and len(entry) in (3, 4) else None


def cache_dir() -> str | None:
    """JAX's persistent compilation cache directory of this process (None: off), where
    the program cache's entries live beside JAX's own."""
    # (a flag jax.config types only as a dynamic attribute)
    return getattr(jax.config, "jax_compilation_cache_dir") or None


def read_and_load(cache_dir: str, key: str, devices) -> tuple | None:
    """(the stored entry of `key`, its program loaded on `devices`), or None: no entry,
    or a damaged or foreign one. Loading is XLA's work without the GIL
    (train/program_prefetch.py runs it in a thread)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    entry = _read(cache_dir, key)
    if entry is None:
        return None
    try:
        payload, stored_in, stored_out = entry[:3]
        compiled = deserialize_and_load(payload, stored_in, stored_out,
                                        execution_devices=list(devices))
    except Exception:  # noqa: BLE001  a damaged or foreign entry is a miss: trace again
        return None
    return entry, compiled


def load(cache_dir: str | None, key: str, in_tree, devices, loaded: tuple | None = None):
    """The stored program of `key` whose argument tree is `in_tree`, loaded on `devices`
    (the ones it was compiled for, in order), or None. `loaded`: `read_and_load`'s answer
    for `key`, made earlier (a prefetch)."""
    if not cache_dir:
        return None
    if loaded is None:
        loaded = read_and_load(cache_dir, key, devices)
    if loaded is None or loaded[0][1] != in_tree:
        return None
    entry, compiled = loaded
    if len(entry) == 3:  # stored before entries carried their program's digest
        program_relink.name(cache_dir, program_relink.program_digest(
            compiled, environment()), key)
    return compiled


def _entry(cache_dir: str, compiled, from_jax_cache: bool, digest: str | None):
    """The entry to store for `compiled` (serialized executable, its argument and output
    trees, its program's digest), or None (JAX's cache answered a program no earlier
    entry holds)."""
    from jax.experimental.serialize_executable import serialize

    if not from_jax_cache:
        return (*serialize(compiled), digest)
    earlier = program_relink.named(cache_dir, digest)
    stored = _read(cache_dir, earlier) if earlier else None
    if stored is None:
        return None
    return (*program_relink.relinked(stored, serialize(compiled),
                                     compiled.runtime_executable().client), digest)


def store(cache_dir: str | None, key: str, compiled, from_jax_cache: bool = False) -> None:
    """Write `compiled` under `key` (atomically; `from_jax_cache`: JAX's persistent cache
    answered it, so the executable comes from an earlier entry of the same program, if
    any); a full or read-only disk only loses the entry (the next run traces and lowers
    again)."""
    if not cache_dir:
        return
    digest = program_relink.program_digest(compiled, environment())
    path = _path(cache_dir, key)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        entry = _entry(cache_dir, compiled, from_jax_cache, digest)
        if entry is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        program_relink.name(cache_dir, digest, key)
    except (OSError, TypeError, ValueError, NotImplementedError, pickle.PicklingError,
            pickle.UnpicklingError, KeyError):
        # NotImplementedError / ValueError: JAX cannot serialize this executable (closed-over
        # constants as arguments, say): it stays in JAX's cache only
        if os.path.exists(tmp):
            os.remove(tmp)
