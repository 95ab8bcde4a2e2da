"""OrchMLLM Algorithm 1 (LPT) on whole lengths (token counts), compiled (numba, no JAX): the
same batches as the vectorised `lpt._lpt_assign`, in time linear in the samples; and the
shared pieces of the whole-length kernels (Algorithms 1, 4 and 5).

* the order: lengths counted per value (`value_counts`), placed longest first, ties by
  index (the kernels walk the counts; no sorted copy of the lengths);
* the lightest bin: a bucket queue over whole loads. The least load never falls, and a bin
  receiving length v > 0 moves from the least load L to L + v, so every load lies in
  [L, L + span) with span = max(spread of the initial loads, longest length) + 1: one list
  of bins per load value, cyclic. The walk to the next non-empty load costs the final least
  load over the whole run; a load's bins are served by index (ordered when the walk reaches
  them: no bin joins the load being served, and a zero length stays where it lands);
* the batches: each pick records its place in its batch, so grouping is a counting sort
  and one scatter (`group`).

Used where the lengths are whole and the loads, the span and the walk stay small (`fits`);
other inputs take the numpy path (`lpt._lpt_assign`). `sum_square_int` (Algorithm 4) and
`conv._conv_whole` (Algorithm 5) share the counts, the picks and `group`.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_MAX_SPAN = 1 << 22  # longest per-value arrays (16 MiB); wider spans take the numpy path


@njit(cache=True)
def whole_stats(x):
    """(max, sum, sum of squares) of ``x``; max -1 if some length is not whole."""
    top, total, total2 = 0.0, 0.0, 0.0
    for v in x:
        if v != np.floor(v):
            return -1.0, 0.0, 0.0
        top = max(top, v)
        total += v
        total2 += v * v
    return top, total, total2


@njit(cache=True)
def value_counts(x, top):
    """How many of the whole lengths ``x`` equal each of 0 .. ``top``."""
    many = np.zeros(top + 1, np.int64)
    for v in x:
        many[np.int64(v)] += 1
    return many


@njit(cache=True)
def _group(x, many, picks, k, counts, flat, order):
    cursor = np.empty(many.size, np.int64)  # where each length's items start, longest first
    pos = 0
    for v in range(many.size - 1, -1, -1):
        cursor[v] = pos
        pos += many[v]
    for i in range(x.size):  # the sorted order, by a counting sort
        v = np.int64(x[i])
        order[cursor[v]] = i
        cursor[v] += 1
    start = np.empty(counts.size, np.int64)
    pos = 0
    for b in range(counts.size):
        start[b] = pos
        pos += counts[b]
    mask = (1 << k) - 1
    for t in range(x.size):
        p = np.int64(picks[t])
        flat[start[p & mask] + (p >> k)] = order[t]


def group(x: np.ndarray, many: np.ndarray, picks: np.ndarray, k: int,
          counts: np.ndarray) -> np.ndarray:
    """The items batch after batch, in pick order. ``picks``: per item in decreasing order
    of length (ties by index; ``many``: items per length), (place in its batch << k) |
    batch; ``counts``: per batch. Two passes that only scatter (the sorted order, then each
    item to its place): a pass that gathered each item's pick waited on memory."""
    flat = np.empty(x.size, np.int64)
    _group(x, many, picks, k, counts, flat, np.empty(x.size, np.int32 if x.size < 2 ** 31
                                                      else np.int64))
    return flat


def pick_bits(n: int, d: int) -> tuple[int, type]:
    """(k, dtype) of the picks (place << k) | batch of ``n`` items over ``d`` batches."""
    k = max(1, (d - 1).bit_length())
    return k, np.int32 if n << k < 2 ** 31 else np.int64


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
    lengths in that order) for whole lengths ``x`` <= ``top``."""
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
def lpt_buckets(many, loads, counts, picks, k, t):
    """The LPT greedy: the whole lengths counted by ``many`` (``many[v]`` of length v),
    longest first, each to the bin of least (load, index); ``loads`` (int64) and ``counts``
    per bin are updated in place; ``picks[t], picks[t + 1], ...`` get each item's (place
    in its bin << k) | bin."""
    d = loads.size
    top = many.size - 1
    while top > 0 and many[top] == 0:
        top -= 1
    lo, hi = loads.min(), loads.max()
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
    for v in range(top, -1, -1):
        for _ in range(many[v]):
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
            picks[t] = (counts[b] << k) | b
            counts[b] += 1
            t += 1
            if v > 0:  # it leaves the least load; a zero length keeps it the least bin
                pos += 1
                s = level + v
                loads[b] = s
                nxt[b] = head[s & mask]
                head[s & mask] = b


def lpt_whole(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Algorithm 1 on lengths ``x``: (items batch after batch, count per batch), as
    `lpt._greedy` gives them; None where this path does not apply (`fits`)."""
    top, total, _ = whole_stats(x)
    n = x.size
    if not fits(top, total, n, d):
        return None
    many = value_counts(x, int(top))
    k, dtype = pick_bits(n, d)
    picks: np.ndarray = np.empty(n, dtype)
    counts = np.zeros(d, np.int64)
    lpt_buckets(many, np.zeros(d, np.int64), counts, picks, k, 0)
    return group(x, many, picks, k, counts), counts
