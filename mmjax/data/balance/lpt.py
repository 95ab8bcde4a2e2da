"""Shared pieces of the post-balancing policies (OrchMLLM §5.1): input checks, sorted orders,
grouping, and the LPT greedy of Algorithm 1 (also DistTrain Algorithm 2)."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def _as_lengths(lengths: Sequence[float], name: str) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of per-sample lengths, "
                         f"got shape {x.shape}")
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0 (tokens per sample)")
    return x


def _check_ranks(num_ranks: int, name: str = "num_ranks") -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"{name} must be a positive int (the DP size), got {num_ranks!r}")


def _lpt_assign(x: np.ndarray, loads: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Greedy: ``items`` (in the given order) each to the bin of least (load, index).

    Returns the bin of each item and updates ``loads`` in place. Exactly the heap algorithm,
    vectorised: a chunk of items takes the next-lightest bins in order as long as none of them
    would rather go to a bin already filled in this chunk (checked per item, so results match
    the heap loop bit for bit); each chunk is usually a whole round of ``d`` items.
    """
    d = loads.size
    bins = np.empty(items.size, dtype=np.int64)
    ranked = np.argsort(loads, kind="stable")
    i = 0
    while i < items.size:
        m = min(d, items.size - i)
        xc = x[items[i:i + m]]
        f = loads[ranked[:m]]
        r = 1
        if m > 1:
            ok = f[1:] < np.minimum.accumulate(f + xc)[:-1]
            r = m if ok.all() else 1 + int(np.argmin(ok))
        chosen = ranked[:r]
        bins[i:i + r] = chosen
        loads[chosen] += xc[:r]
        ranked = np.argsort(loads, kind="stable")
        i += r
    return bins


def _small_ints(x: np.ndarray) -> bool:
    return bool(x.size) and x.max() < 65536 and bool(np.all(x == np.floor(x)))


def _descending(x: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, ties by increasing index (radix sort for token counts)."""
    if _small_ints(x):
        return np.argsort((65535 - x).astype(np.uint16), kind="stable")
    return np.argsort(-x, kind="stable")


def _ascending(x: np.ndarray) -> np.ndarray:
    if _small_ints(x):
        return np.argsort(x.astype(np.uint16), kind="stable")
    return np.argsort(x, kind="stable")


def _group(bins: np.ndarray, items: np.ndarray, d: int) -> list[list[int]]:
    """Items per bin, keeping their order (vectorised: the lists are built in one pass)."""
    keys = bins.astype(np.uint16) if d <= 65536 else bins
    flat = items[np.argsort(keys, kind="stable")].tolist()
    ends = np.cumsum(np.bincount(bins, minlength=d)).tolist()
    return [flat[s:e] for s, e in zip([0] + ends[:-1], ends)]


def greedy_partition(sizes: Sequence[float], num_bins: int,
                     name: str = "lengths") -> list[list[int]]:
    """LPT greedy number partitioning: largest first, each to the lightest bin (4/3 - 1/(3d)).

    OrchMLLM Algorithm 1 and DistTrain Algorithm 2 (see ``reorder.intra_reorder``). Returns
    sample indices per bin, in assignment order (descending size).
    """
    _check_ranks(num_bins, "num_bins")
    x = _as_lengths(sizes, name)
    items = _descending(x)
    return _group(_lpt_assign(x, np.zeros(int(num_bins)), items), items, int(num_bins))
