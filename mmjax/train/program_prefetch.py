"""The program a run last used, loading from the program cache (train/program_cache.py)
while the run starts (issue 41: a warm start's first step).

A stored step's key holds its batch shapes, so it is known only once the data's shapes
are scanned and the model built abstractly; loading the executable is then XLA's work
(1.0-1.3 s for the tiny step on this CPU) on the first step's path. Each run instead
remembers, under a key of what it is (`program_cache.program_key` of its description:
versions, environment, mmjax's source, gin bindings less `train.steps`, devices), the
program key its step last had, and loads that entry in a thread from the moment it is
built, beside the shape scan, the abstract build and the init (XLA loads without the
GIL). The program is used only when the step's own key, computed as before, is the
remembered one: a run whose shapes changed wastes the load, never takes a wrong program.
"""
from __future__ import annotations

import concurrent.futures
import os

from mmjax.train import program_cache


class Prefetch:
    """The stored program of `key` in `cache_dir`, loading on `devices` in a thread;
    `take(key)` answers it. Made by `remembered`, it also keeps the index of `what` a run
    is: `remember(key)` records the key its step had, for the next run."""

    def __init__(self, cache_dir: str | None, key: str | None, devices,
                 index: str | None = None):
        self.key, self._index = key, index
        self._future: concurrent.futures.Future | None = None
        if cache_dir and key:
            pool = concurrent.futures.ThreadPoolExecutor(1, "mmjax-prefetch")
            self._future = pool.submit(program_cache.read_and_load, cache_dir, key,
                                       list(devices))
            pool.shutdown(wait=False)  # the thread ends with its one load

    @classmethod
    def remembered(cls, cache_dir: str | None, what: str, devices) -> Prefetch:
        """The program the last run of `what` (a description: the model, the settings)
        on `devices` had, loading; nothing with the cache off or no run before."""
        if not cache_dir:
            return cls(None, None, devices)
        index = os.path.join(cache_dir, "mmjax-program-last-"
                             + program_cache.program_key(what, *map(str, devices)))
        try:
            with open(index) as f:
                key = f.read().strip() or None
        except OSError:
            key = None
        return cls(cache_dir, key, devices, index)

    def take(self, key: str) -> tuple | None:
        """`program_cache.read_and_load`'s answer for `key` when it is the one loading
        (waiting for the load if it is still running), else None."""
        if self._future is None or key != self.key:
            return None
        return self._future.result()

    def remember(self, key: str) -> None:
        """Record `key` in the index (atomically; a read-only or full disk only loses the
        prefetch of the next run); no index, nothing."""
        if self._index is None or not key or key == self.key:
            return
        tmp = f"{self._index}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(key)
            os.replace(tmp, self._index)
            self.key = key
        except OSError:
            if os.path.exists(tmp):
                os.remove(tmp)
