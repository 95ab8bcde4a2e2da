"""What a run's pretrained weights were, so frozen units can be rebuilt bit for bit.

Frozen parameters are not in the checkpoints (train/logical_state.py): a resumed run, an
export and `generate.py` re-read them from the pretrained directories. A directory that was
changed or removed since would silently give other weights, so run.json records, per unit,
every safetensors file the unit was loaded from with its size, modification time and
SHA-256. `verify` checks the files against that record (size first; the hash is recomputed
only when the modification time moved) and fails in one line naming the unit and file.
"""
from __future__ import annotations

import hashlib
import os

from mmjax.errors import UserError
from mmjax.models.hf.checkpoint import Checkpoint

_CHUNK = 1 << 24


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _files(directory: str) -> list[str]:
    """The safetensors files a load of `directory` reads (shards named by the index)."""
    return sorted(str(p) for p in set(Checkpoint(directory).file.values()))


def _entry(path: str, known: dict | None) -> dict:
    st = os.stat(path)
    if known and known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns:
        return dict(known)  # unchanged since it was hashed
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256(path)}


def record(dirs: dict, previous: dict | None = None) -> dict:
    """{unit: {"dir": absolute dir, "files": {file name: {size, mtime_ns, sha256}}}} of the
    pretrained directories `dirs` ({unit: dir}); hashes in `previous` (an earlier record)
    are reused for files whose size and modification time did not change."""
    out = {}
    for unit, d in sorted(dirs.items()):
        d = os.path.abspath(d)
        old = (previous or {}).get(unit, {})
        old_files = old.get("files", {}) if old.get("dir") == d else {}
        out[unit] = {"dir": d, "files": {
            os.path.relpath(f, d): _entry(f, old_files.get(os.path.relpath(f, d)))
            for f in _files(d)}}
    return out


def verify(recorded: dict) -> dict:
    """Check every unit's files against `recorded` (a `record`); -> {unit: dir}. Raises
    UserError (one line) when a directory or file is gone, or a file's size or SHA-256
    differs from what the run was trained with."""
    fix = ("restore the files the run trained with (frozen units are rebuilt from them, "
           "they are not in the checkpoints)")
    for unit, rec in sorted(recorded.items()):
        d = rec["dir"]
        if not os.path.isdir(d):
            raise UserError(f"pretrained.{unit}: {d} is gone: {fix}")
        try:
            now = {os.path.relpath(f, d) for f in _files(d)}
        except (ValueError, FileNotFoundError) as e:
            raise UserError(f"pretrained.{unit}: {d} is no longer readable ({e}): {fix}") \
                from None
        if now != set(rec["files"]):
            raise UserError(f"pretrained.{unit}: {d} now holds {sorted(now)}, the run trained "
                            f"with {sorted(rec['files'])}: {fix}")
        for name, want in sorted(rec["files"].items()):
            path = os.path.join(d, name)
            got = _entry(path, want)
            what = ("size" if got["size"] != want["size"] else
                    "sha256" if got["sha256"] != want["sha256"] else None)
            if what:
                raise UserError(f"pretrained.{unit}: {path} changed since the run trained "
                                f"with it ({what} differs): {fix}")
    return {unit: rec["dir"] for unit, rec in recorded.items()}


def same_sources(a: dict, b: dict) -> bool:
    """Two records describe the same content (directories may have moved)."""
    return ({u: {n: f["sha256"] for n, f in r["files"].items()} for u, r in a.items()}
            == {u: {n: f["sha256"] for n, f in r["files"].items()} for u, r in b.items()})
