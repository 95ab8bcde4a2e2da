"""OrchMLLM Appendix A, Algorithm 5 ("conv" post-balancing: padded attention)."""
from __future__ import annotations

import numpy as np
from numba import njit

from mmjax.data.balance.lpt_int import (fits, group, lpt_buckets, pick_bits, value_counts,
                                        whole_stats)
from mmjax.data.balance.lpt import _lpt_assign, _place, _sorted_by


def _conv(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 5 (ConvTransformer: padded attention, cost L + lambda * b * max^2).

    Phase 1: descending lengths packed into batches whose padded size (count * first length)
    stays within Algorithm 1's objective, at most d batches (groups similar lengths, so
    little padding). Phase 2: the remaining lengths go greedily to the batch of least sum.
    Deviation: the paper tests ``(count + 1) * s.length``; the padded size of a descending
    batch is set by its first (longest) element, which is what we use. Returns
    (samples batch after batch, count per batch). Token counts run compiled
    (`_conv_whole`), other lengths on numpy.
    """
    out = _conv_whole(x, d)
    if out is not None:
        return out
    desc, xs = _sorted_by(x, True)
    lpt_loads = np.zeros(d)
    _lpt_assign(x, lpt_loads, desc, xs=xs)
    bound = float(lpt_loads.max())
    n = x.size
    # Python floats, no numpy scalar per step (numpy declares the buffer protocol only for 3.12+)
    v = memoryview(xs)  # type: ignore[arg-type]
    ends: list[int] = []
    i = 0
    while i < n and len(ends) < d:
        xi = v[i]
        j = i + int(bound // xi) if xi > 0 else n  # zero lengths: all the rest
        i = n if j > n else (i + 1 if j <= i else j)
        ends.append(i)
    ends_a = np.array(ends, dtype=np.int64)
    sizes = np.diff(ends_a, prepend=0)
    bins, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    bins[:i] = np.repeat(np.arange(len(ends)), sizes)
    slots[:i] = np.arange(i) - np.repeat(ends_a - sizes, sizes)
    loads = np.bincount(bins[:i], weights=xs[:i], minlength=d)
    counts = np.zeros(d, dtype=np.int64)
    counts[:len(ends)] = sizes
    bins[i:], slots[i:] = _lpt_assign(x, loads, desc[i:], counts, xs[i:])
    return _place(bins, slots, desc, counts)


@njit(cache=True)
def _pack(many, bound, loads, counts, picks, k):
    """Phase 1 on the whole lengths counted by ``many``, longest first: consecutive batches
    of padded size count * first length <= ``bound``, at most ``loads.size``; fills
    ``loads``, ``counts`` (zeros) and the picks of the packed items, and takes them out of
    ``many``. -> how many it packed."""
    d, n = loads.size, many.sum()
    v = many.size - 1
    i, b = 0, 0
    while i < n and b < d:
        while many[v] == 0:
            v -= 1
        xi = float(v)
        j = i + int(bound // xi) if xi > 0 else n  # zero lengths: all the rest
        j = n if j > n else (i + 1 if j <= i else j)
        for slot in range(j - i):
            while many[v] == 0:
                v -= 1
            many[v] -= 1
            loads[b] += v
            picks[i + slot] = (slot << k) | b
        counts[b] = j - i
        i = j
        b += 1
    return i


def _conv_whole(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Algorithm 5 on token counts: both greedy passes on `lpt_int.lpt_buckets`, the
    packing compiled; the batches of the numpy path. None where `lpt_int.fits` does not
    hold (phase 2 starts from loads up to Algorithm 1's objective <= total / d + longest)."""
    top, total, _ = whole_stats(x)
    n = x.size
    if not fits(top, total, n, d, spread=total / d + top):
        return None
    many = value_counts(x, int(top))
    k, dtype = pick_bits(n, d)
    picks: np.ndarray = np.empty(n, dtype)
    loads, counts = np.zeros(d, np.int64), np.zeros(d, np.int64)
    lpt_buckets(many, loads, counts, picks, k, 0)  # Algorithm 1: the bound
    bound = float(loads.max())
    loads[:], counts[:] = 0, 0
    rest = many.copy()
    i = _pack(rest, bound, loads, counts, picks, k)
    lpt_buckets(rest, loads, counts, picks, k, i)
    return group(x, many, picks, k, counts), counts
