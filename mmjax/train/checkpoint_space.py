"""A checkpoint that cannot be written (disk full, quota, permission, read-only filesystem)
stops the run at once, in one line naming the directory and the space a checkpoint needs.

Two checks: before a save starts, this process's bytes to write (`state_bytes`, with
`needed_bytes`' margin for orbax's files) against the free space of the directory's
filesystem; after it, the background write's error (`write_failure_reason` turns the OS
error inside tensorstore's message into words). Either way the unfinished save's temporary
directory is removed and the earlier checkpoints stay: a rerun resumes from the newest.
"""
from __future__ import annotations

import re
import shutil

MB = 1 << 20


class SaveFailed(RuntimeError):
    """A checkpoint could not be written (one-line reason; earlier checkpoints intact)."""


# OS errors a save can meet (errno: words); tensorstore writes them as [os_error_code='28']
_OS_ERRORS = {28: "the disk is full", 122: "the disk quota is exceeded",
              13: "permission denied", 1: "operation not permitted",
              30: "the filesystem is read-only", 27: "a file is larger than allowed"}
_WORDS = {"No space left on device": 28, "Disk quota exceeded": 122,
          "Permission denied": 13, "Operation not permitted": 1,
          "Read-only file system": 30, "File too large": 27}
_CODE = re.compile(r"os_error_code='?(\d+)")


def write_failure_reason(err: BaseException) -> str:
    """What went wrong with a write, in a few words (the OS error when there is one)."""
    e: BaseException | None = err
    texts: list[str] = []
    while e is not None and len(texts) < 8:
        texts.append(str(e))
        if isinstance(e, OSError) and e.errno in _OS_ERRORS:
            return _OS_ERRORS[e.errno]
        e = e.__cause__ or e.__context__
    text = " ".join(texts)
    m = _CODE.search(text)
    if m and int(m.group(1)) in _OS_ERRORS:
        return _OS_ERRORS[int(m.group(1))]
    for words, code in _WORDS.items():
        if words in text:
            return _OS_ERRORS[code]
    first = " ".join(str(err).split())
    return f"{type(err).__name__}: {first[:160]}{'...' if len(first) > 160 else ''}"


def state_bytes(arrays) -> int:
    """The bytes this process writes for `arrays`: its shards with replica_id 0 (a host
    value is written by process 0)."""
    import jax
    import numpy as np

    total = 0
    for x in arrays:
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if not s.replica_id)
        elif jax.process_index() == 0:
            total += np.asarray(x).nbytes
    return total


def needed_bytes(state: int) -> int:
    """Free space to ask for before writing `state` bytes: orbax's OCDBT files and the JSON
    items add a little per array and per checkpoint (measured: 3.7 MB on disk, `du`, for
    the tiny model's 3.5 MB of state)."""
    return int(state * 1.05) + MB // 4


def free_bytes(directory: str) -> int:
    """Free bytes for an unprivileged writer on `directory`'s filesystem."""
    return shutil.disk_usage(directory).free


def size_words(n: int) -> str:
    return f"{n / MB:.1f} MB" if n < 10 * (1 << 30) else f"{n / (1 << 30):.1f} GB"


def save_failed_line(step: int, directory: str, reason: str, need: int, free: int) -> str:
    return (f"cannot write checkpoint step {step} to {directory}: {reason} ({size_words(free)}"
            f" free there, a checkpoint needs about {size_words(need)}; free space there or "
            f"move the workdir, then rerun to resume)")
