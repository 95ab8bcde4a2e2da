"""OrchMLLM Algorithm 1 (LPT) on whole lengths (token counts), compiled (numba, no JAX): the
same batches as the vectorised `lpt._lpt_assign`, in time linear in the samples.

* the order: a counting sort (samples per length; longest or shortest first, ties by index);
* the lightest bin: a bucket queue over whole loads. The least load never falls, and a bin
  receiving length v > 0 moves from the least load L to L + v, so every load lies in
  [L, L + span) with span = max(spread of the initial loads, longest length) + 1: one list
  of bins per load value, cyclic. The walk to the next non-empty load costs the final least
  load over the whole run; a load's bins are served by index (sorted when the walk reaches
  them: no bin joins the load being served, and a zero length stays where it lands);
* the batches: each pick records its place in its batch, so grouping is one scatter.

Used where the lengths are whole and the loads, the span and the walk stay small (`fits`);
other inputs take the numpy path (`lpt._lpt_assign`).
"""
from __future__ import annotations

import numpy as np
from numba import njit

_MAX_SPAN = 1 << 22  # longest per-load arrays (16 MiB); wider spans take the numpy path


@njit(cache=True)
def whole_stats(x):
    """(max, sum) of ``x``; max -1 if some length is not whole."""
    top, total = 0.0, 0.0
    for v in x:
        if v != np.floor(v):
            return -1.0, 0.0
        top = max(top, v)
        total += v
    return top, total


def sortable(top: float, n: int) -> bool:
    """Whether `counting_order` applies: whole lengths (``top`` >= 0, from `whole_stats`)
    and a per-value array no longer than the samples warrant."""
    return 0 <= top <= min(16 * n + 65536, _MAX_SPAN)


def fits(top: float, total: float, n: int, d: int, spread: float = 0.0) -> bool:
    """Whether `lpt_buckets` applies to ``n`` lengths (max ``top``, sum ``total``) on ``d``
    bins whose loads differ by at most ``spread``: `sortable`, sums exact in int64 and
    float64, the per-load arrays and the bucket walk (about the final least load, <=
    spread + total / d) no longer than the samples warrant."""
    return (sortable(top, n) and total + spread < 2.0 ** 52 and spread < _MAX_SPAN
            and spread + total / d <= 64 * (n + d) + 65536)


@njit(cache=True)
def _counting_order(x, start, descending, order, xs):
    """Fill ``order`` with the sample indices by length (decreasing or increasing; ties by
    increasing index) and ``xs`` with the lengths in that order: a counting sort of whole
    lengths ``x``, ``start`` (zeros) one longer than the longest."""
    n, top = x.size, start.size - 1
    for v in x:
        start[np.int64(v)] += 1
    pos = 0
    for j in range(top + 1):
        v = top - j if descending else j
        c = start[v]
        start[v] = pos
        pos += c
    for i in range(n):
        v = np.int64(x[i])
        p = start[v]
        start[v] = p + 1
        order[p] = i
        xs[p] = x[i]


def counting_order(x: np.ndarray, top: int, descending: bool) -> tuple[np.ndarray, np.ndarray]:
    """(sample indices by length, decreasing or increasing, ties by increasing index; the
    lengths in that order) for whole lengths ``x`` <= ``top``. numpy allocates the arrays
    (it reuses freed pages, numba's page-fault)."""
    order, xs = np.empty(x.size, np.int64), np.empty(x.size, np.float64)
    _counting_order(x, np.zeros(top + 1, np.int64), descending, order, xs)
    return order, xs


# bit index of a 32-bit power of two p: _DEBRUIJN[((p * 0x077CB531) & 0xFFFFFFFF) >> 27]
_DEBRUIJN = (0, 1, 28, 2, 29, 14, 24, 3, 30, 22, 20, 15, 25, 17, 4, 8,
             31, 27, 13, 23, 21, 19, 16, 7, 26, 12, 18, 6, 11, 5, 10, 9)


@njit(cache=True, inline="always")
def _by_index(cur, ncur, bits, debruijn):
    """Sort the bins ``cur[:ncur]`` (distinct) by index: insertion sort for a few, else
    through the bitmap ``bits`` (32 bins per word, left all zero): set, then read out."""
    if ncur <= 16:
        for i in range(1, ncur):
            v, j = cur[i], i - 1
            while j >= 0 and cur[j] > v:
                cur[j + 1] = cur[j]
                j -= 1
            cur[j + 1] = v
        return
    lo, hi = bits.size, 0
    for i in range(ncur):
        b = np.int64(cur[i])
        q = b >> 5
        bits[q] |= np.int64(1) << (b & 31)
        lo, hi = min(lo, q), max(hi, q)
    k = 0
    for q in range(lo, hi + 1):
        word = bits[q]
        bits[q] = 0
        while word != 0:
            low = word & -word
            cur[k] = (q << 5) | debruijn[((low * 0x077CB531) & 0xFFFFFFFF) >> 27]
            k += 1
            word ^= low


@njit(cache=True)
def lpt_buckets(xs, loads, counts, bins, slots):
    """The LPT greedy: each whole length of ``xs`` in turn to the bin of least (load,
    index); ``loads`` (int64) and ``counts`` per bin are updated in place; ``bins`` and
    ``slots`` get each item's bin and place in it (counting from the bin's count)."""
    d, n = loads.size, xs.size
    if n == 0:
        return
    lo, hi = loads.min(), loads.max()
    top = np.int64(xs.max())
    span = max(hi - lo, top) + 1
    w = 1
    while w < span:
        w *= 2
    mask = w - 1
    head = np.full(w, -1, np.int32)  # per load value (cyclic), its first bin (-1: none)
    nxt = np.empty(d, np.int32)  # the next bin of the same load
    for b in range(d - 1, -1, -1):  # each list in increasing bin order
        s = loads[b] & mask
        nxt[b] = head[s]
        head[s] = b
    cur = np.empty(d, np.int32)  # the bins of the least load, by index
    bits = np.zeros((d + 31) // 32, np.int64)
    debruijn = np.array(_DEBRUIJN, np.int64)
    pos, ncur, level = 0, 0, lo - 1
    for t in range(n):
        if pos == ncur:  # walk to the next load that has bins
            level += 1
            while head[level & mask] < 0:
                level += 1
            c = head[level & mask]
            head[level & mask] = -1
            ncur, pos = 0, 0
            while c >= 0:
                cur[ncur] = c
                ncur += 1
                c = nxt[c]
            _by_index(cur, ncur, bits, debruijn)
        b = cur[pos]
        bins[t] = b
        slots[t] = counts[b]
        counts[b] += 1
        v = np.int64(xs[t])
        if v > 0:  # it leaves the least load; a zero length keeps it the least bin
            pos += 1
            s = level + v
            loads[b] = s
            nxt[b] = head[s & mask]
            head[s & mask] = b


@njit(cache=True)
def _place(bins, slots, items, counts, start, flat):
    pos = 0
    for b in range(counts.size):
        start[b] = pos
        pos += counts[b]
    for t in range(items.size):
        flat[start[bins[t]] + slots[t]] = items[t]


def place(bins: np.ndarray, slots: np.ndarray, items: np.ndarray,
          counts: np.ndarray) -> np.ndarray:
    """Items batch after batch, each at its slot: `lpt._place` compiled."""
    flat = np.empty(items.size, np.int64)
    _place(bins, slots, items, counts, np.empty(counts.size, np.int64), flat)
    return flat


def lpt_whole(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Algorithm 1 on lengths ``x``: (items batch after batch, count per batch), as
    `lpt._greedy` gives them; None where this path does not apply (`fits`)."""
    top, total = whole_stats(x)
    if not fits(top, total, x.size, d):
        return None
    order, xs = counting_order(x, int(top), True)
    n = x.size
    counts = np.zeros(d, np.int64)
    bins, slots = np.empty(n, np.int64), np.empty(n, np.int64)
    lpt_buckets(xs, np.zeros(d, np.int64), counts, bins, slots)
    return place(bins, slots, order, counts), counts
