"""Sidecar metadata index: per record what planning needs, computed once (no JAX).

Planning (balancing, reordering, bucket shapes) reads only metadata (OrchMLLM §7: the
global orchestrator works on "the counts of subsequences ... and the order in which they
are interleaved"), so a source computes it once per data set: image sizes from file headers
(Pillow reads them without decoding pixels), audio lengths from headers (soundfile), token
counts from the tokenizer. `cached_index` runs the per-record function in parallel (threads
for small sets, whose work is header I/O; spawned processes above `process_threshold`
records, where rendering and tokenising dominate) with a progress bar, and stores the
result next to the data under a key of everything it depends on (the data's bytes or
stats, the tokenizer's fingerprint, the chat settings): a changed key rebuilds it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_context


def file_digest(path: str) -> str:
    """sha256 of a file's bytes (the annotation file of a data set)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def index_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _writable_path(path: str) -> str:
    """`path`, or a per-user cache path when the data's directory is read-only."""
    if os.access(os.path.dirname(os.path.abspath(path)) or ".", os.W_OK):
        return path
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    alt = os.path.join(cache, "mmjax", hashlib.sha256(os.path.abspath(path).encode()
                                                      ).hexdigest()[:16] + ".json")
    os.makedirs(os.path.dirname(alt), exist_ok=True)
    return alt


def _run(fn, items, workers: int, process_threshold: int, label: str) -> list:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    out = [None] * len(items)
    chunk = max(1, min(256, len(items) // (4 * max(workers, 1)) or 1))
    chunks = [list(range(i, min(i + chunk, len(items)))) for i in range(0, len(items), chunk)]
    use_processes = workers > 1 and len(items) >= process_threshold
    pool = (ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if use_processes
            else ThreadPoolExecutor(max(workers, 1)))
    with pool, Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                        console=Console(stderr=True), disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(label, total=len(items))
        futures = [(c, pool.submit(_apply_chunk, fn, [items[i] for i in c])) for c in chunks]
        for c, fut in futures:
            for i, value in zip(c, fut.result()):
                out[i] = value
            bar.update(task, advance=len(c))
    return out


def _apply_chunk(fn, items: list) -> list:
    return [fn(x) for x in items]


def cached_index(path: str, key: str, items: list, fn, workers: int = 8,
                 process_threshold: int = 4096, label: str = "indexing") -> list:
    """[fn(item) for item in items] (JSON-able values), cached at `path` under `key`.
    `fn` must be picklable (a module-level function or an object) when processes are used."""
    for candidate in (path, _writable_path(path)):
        if os.path.isfile(candidate):
            try:
                with open(candidate) as f:
                    cached = json.load(f)
                if cached.get("key") == key and len(cached.get("entries", [])) == len(items):
                    return cached["entries"]
            except (OSError, ValueError):
                pass  # unreadable cache: rebuild it
    entries = _run(fn, items, workers, process_threshold, label)
    target = _writable_path(path)
    tmp = target + f".tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"key": key, "entries": entries}, f)
    os.replace(tmp, target)
    return entries
