"""Shared pieces of the post-balancing policies (OrchMLLM §5.1): input checks, sorted orders,
grouping, and the LPT greedy of Algorithm 1 (also DistTrain Algorithm 2)."""
from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from mmjax.data.balance.lpt_int import counting_order, lpt_whole, sortable, whole_stats


def _as_lengths(lengths: Sequence[float] | np.ndarray, name: str) -> np.ndarray:
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


def _lpt_assign(x: np.ndarray, loads: np.ndarray, items: np.ndarray,
                counts: np.ndarray | None = None,
                xs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy: ``items`` (in the given order) each to the bin of least (load, index).

    Returns (bin, slot) per item, slot = the item's place in its bin counting from
    ``counts`` (items already there; updated in place, as ``loads`` is). Exactly the heap
    algorithm, vectorised: a chunk of items takes the next-lightest bins in order as long as
    none of them would rather go to a bin already filled in this chunk (checked per item, so
    results match the heap loop bit for bit); each chunk is usually a whole round of ``d``
    items and gives each bin at most one item, so slots are counted per chunk. Whole
    lengths (token counts) run on int64 keys (`_lpt_keys`): one plain sort per chunk
    instead of a stable argsort.
    """
    d = loads.size
    counts = np.zeros(d, dtype=np.int64) if counts is None else counts
    xs = x[items] if xs is None else xs
    if items.size and _int_keys_fit(x, loads):
        return _lpt_keys(xs, loads, counts)
    bins = np.empty(items.size, dtype=np.int64)
    slots = np.empty(items.size, dtype=np.int64)
    ranked = np.argsort(loads, kind="stable")
    i = 0
    while i < items.size:
        m = min(d, items.size - i)
        xc = xs[i:i + m]
        f = loads[ranked[:m]]
        r = 1
        if m > 1:
            ok = f[1:] < np.minimum.accumulate(f + xc)[:-1]
            r = m if ok.all() else 1 + int(np.argmin(ok))
        chosen = ranked[:r]
        bins[i:i + r] = chosen
        slots[i:i + r] = counts[chosen]
        counts[chosen] += 1
        loads[chosen] += xc[:r]
        ranked = np.argsort(loads, kind="stable")
        i += r
    return bins, slots


def _int_keys_fit(x: np.ndarray, loads: np.ndarray) -> bool:
    """Whole lengths (all of ``x``) and loads whose keys load * 2^k + bin stay below 2^62."""
    k = max(1, int(loads.size - 1).bit_length())
    top = float(loads.max()) + float(x.sum())
    return (top < 2.0 ** (62 - k) and bool(np.all(x == np.floor(x)))
            and bool(np.all(loads == np.floor(loads))))


def _lpt_keys(xs: np.ndarray, loads: np.ndarray,
              counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_lpt_assign` on int64 keys (load << k) | bin: keys are distinct and order bins by
    (load, index), so the heap's choice is the least key. A chunk's t-th item goes to the
    t-th least key as long as that key is below every key already raised in the chunk."""
    d = loads.size
    k = max(1, int(d - 1).bit_length())
    mask = (1 << k) - 1
    keys = np.sort((loads.astype(np.int64) << k) | np.arange(d, dtype=np.int64))
    xi = xs.astype(np.int64) << k
    n = xs.size
    bins = np.empty(n, dtype=np.int64)
    slots = np.empty(n, dtype=np.int64)
    # while every bin holds the same count (a fresh start, then whole rounds), a whole
    # round's slots are that count and every bin gains one: no gather, no scatter
    even = counts.size == 0 or counts.min() == counts.max()
    i = 0
    while i < n:
        m = min(d, n - i)
        new = keys[:m] + xi[i:i + m]
        r = m
        if m > 1:
            late = np.flatnonzero(keys[1:m] > np.minimum.accumulate(new[:-1]))
            if late.size:
                r = 1 + int(late[0])
        chosen = np.bitwise_and(keys[:r], mask, out=bins[i:i + r])
        if r == d and even:
            slots[i:i + r] = counts[0]
            counts += 1
        else:
            np.take(counts, chosen, out=slots[i:i + r])
            counts[chosen] += 1
            even = even and r == d
        if r == d:
            new.sort()
            keys = new
        else:
            keys = np.sort(np.concatenate((new[:r], keys[r:])))
        i += r
    loads[keys & mask] = (keys >> k).astype(np.float64)
    return bins, slots


def _sorted_by(x: np.ndarray, descending: bool,
               top: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(indices by length, decreasing or increasing, ties by increasing index; the lengths
    in that order). Token counts take a compiled counting sort (`lpt_int.counting_order`),
    other lengths a stable argsort. ``top``: `lpt_int.whole_stats`' max, if known."""
    top = whole_stats(x)[0] if top is None else top
    if sortable(top, x.size):
        return counting_order(x, int(top), descending)
    order = np.argsort(-x if descending else x, kind="stable")
    return order, x[order]


def _descending(x: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, ties by increasing index."""
    return _sorted_by(x, True)[0]


def _group(bins: np.ndarray, items: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Items per bin, keeping their order: (items bin after bin, count per bin)."""
    keys = bins.astype(np.uint16) if d <= 65536 else bins
    return items[np.argsort(keys, kind="stable")], np.bincount(bins, minlength=d)


def _place(bins: np.ndarray, slots: np.ndarray, items: np.ndarray,
           counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_group` when each item's slot in its bin is known: one scatter, no sort."""
    flat = np.empty(items.size, dtype=np.int64)
    flat[(np.cumsum(counts) - counts)[bins] + slots] = items
    return flat, counts


def _lists(flat: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    """(items bin after bin, count per bin) as one list of sample indices per bin."""
    if counts.size and counts.min() == counts.max():  # equal batches: one 2-D tolist
        return flat.reshape(counts.size, -1).tolist()
    items = flat.tolist()
    ends = np.cumsum(counts).tolist()
    return [items[s:e] for s, e in zip([0] + ends[:-1], ends)]


def _flat(batches: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `_lists`."""
    counts = np.array([len(b) for b in batches], dtype=np.int64)
    return np.fromiter(itertools.chain.from_iterable(batches), np.int64, int(counts.sum())), counts


def _greedy(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 1 on checked lengths, grouped (`_group`): compiled on token counts
    (`lpt_int.lpt_whole`), else vectorised rounds (`_lpt_assign`)."""
    out = lpt_whole(x, d)
    if out is not None:
        return out
    items, xs = _sorted_by(x, True)
    counts = np.zeros(d, dtype=np.int64)
    bins, slots = _lpt_assign(x, np.zeros(d), items, counts, xs)
    return _place(bins, slots, items, counts)


def greedy_partition(sizes: Sequence[float], num_bins: int,
                     name: str = "lengths") -> list[list[int]]:
    """LPT greedy number partitioning: largest first, each to the lightest bin (4/3 - 1/(3d)).

    OrchMLLM Algorithm 1 and DistTrain Algorithm 2 (see ``reorder.intra_reorder``). Returns
    sample indices per bin, in assignment order (descending size).
    """
    _check_ranks(num_bins, "num_bins")
    return _lists(*_greedy(_as_lengths(sizes, name), int(num_bins)))
