"""Compiled inner loops of the post-balancing policies (numba, no JAX): the greedy steps that
cannot be vectorised, one sample (or one batch) at a time, on array heaps.

Each kernel computes exactly what the Python implementation it replaced did (tests compare
them with the literal algorithms and the frozen previous implementation on random inputs,
ties included): `sum_square_heap` is the heap loop of OrchMLLM Algorithm 4 for any
lengths (whole lengths take `sum_square_int`, the same batches on integer structures),
`least_batches` is Algorithm 2's GETLEASTBATCHES. (Algorithm 1's LPT on token counts is
`lpt_int`'s bucket queue; on other lengths numpy's vectorised rounds, `lpt._lpt_assign`,
which beat a compiled heap.) numba compiles them on first use and caches the machine code
next to this file (`cache=True`), so a process pays the compile once per machine.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _before(ka, ba, kb, bb):
    """(ka, ba) < (kb, bb): key, then bin index."""
    return ka < kb or (ka == kb and ba < bb)


@njit(cache=True, inline="always")
def _rise(h, hb, i, v, b):
    """Put (v, b) in the hole at `i` of the min-heap h/hb by (key, bin), moving it up."""
    while i > 0:
        p = (i - 1) >> 1
        if _before(h[p], hb[p], v, b):
            break
        h[i], hb[i] = h[p], hb[p]
        i = p
    h[i], hb[i] = v, b


@njit(cache=True, inline="always")
def _push(h, hb, n, v, b):
    """Insert (v, b) into the min-heap h/hb[:n]; -> the new size."""
    _rise(h, hb, n, v, b)
    return n + 1


@njit(cache=True, inline="always")
def _replace_top(h, hb, n, v, b):
    """Remove the root of the min-heap h/hb[:n] and insert (v, b), Floyd's bottom-up way:
    the hole goes down to a leaf along the lesser children (a select per level rather than
    a hard-to-predict branch), then (v, b) rises from there, usually a level or two."""
    i = 0
    while True:
        c = 2 * i + 1
        if c + 1 < n:
            c = c + 1 if _before(h[c + 1], hb[c + 1], h[c], hb[c]) else c
        elif c >= n:
            break
        h[i], hb[i] = h[c], hb[c]
        i = c
    _rise(h, hb, i, v, b)


@njit(cache=True)
def sum_square_heap(xs, d, tolerance):
    """OrchMLLM Algorithm 4 on lengths ``xs`` in the order they are placed: each goes to the
    batch of least (square-sum, index) among those whose sum is below the least sum +
    ``tolerance`` > 0 (the window). The least sum never falls, so a bin leaves the window
    only by receiving an item, and re-enters once the rising bound passes its sum:
    window bins in a heap by (square-sum, bin), whose root is the receiver; the others in
    buckets of width tolerance / 8 by sum (a bucket queue: a bin waits at a sum at least the
    bound, so the buckets below the bound empty wholly, the bound's own is scanned); the
    least sum of all bins from a min-tree over the bins (one leaf-to-root path per item,
    stopping where the minimum is unchanged). -> the bin of each item."""
    n = xs.size
    size = 1
    while size < d:
        size *= 2
    sums, squares = np.zeros(d), np.zeros(d)
    low = np.full(2 * size, np.inf)  # low[1]: the least sum; leaves at size + bin
    low[size:size + d] = 0.0
    for i in range(size - 1, 0, -1):
        low[i] = min(low[2 * i], low[2 * i + 1])
    qh, qb, nq = np.zeros(d), np.arange(d), d  # the window: all bins, (0.0, b) is a heap
    width = tolerance / 8.0
    # a waiting sum lies below the bound + the largest item: that many buckets, cyclic;
    # fewer (bounded memory) only share buckets, every entry is checked against the bound
    span = (tolerance + (xs.max() if n else 0.0)) / width
    nb = int(min(span, 4.0 * d + 64.0)) + 4
    head = np.full(nb, -1, np.int64)  # per bucket, its first waiting bin (-1: none)
    nxt = np.empty(d, np.int64)  # the next bin in the same bucket
    kcur, waiting, last = 0, 0, -1.0
    bins = np.empty(n, np.int64)
    for t in range(n):
        bound = low[1] + tolerance
        if waiting > 0 and bound > last:  # bins the risen bound lets into the window
            last = bound
            kb = int(bound // width)
            for k in range(max(kcur, kb - nb + 1), kb + 1):
                slot = k % nb
                b, keep = head[slot], -1
                while b >= 0:
                    after = nxt[b]
                    if sums[b] < bound:
                        nq = _push(qh, qb, nq, squares[b], b)
                        waiting -= 1
                    else:
                        nxt[b] = keep
                        keep = b
                    b = after
                head[slot] = keep
            kcur = kb
        b = qb[0]
        bins[t] = b
        v = xs[t]
        s = sums[b] + v
        sums[b] = s
        squares[b] += v * v
        low[size + b] = s
        i = (b + size) >> 1
        while i >= 1:
            m = min(low[2 * i], low[2 * i + 1])
            if low[i] == m:
                break
            low[i] = m
            i >>= 1
        if s < low[1] + tolerance:  # still in the window, with its new square-sum
            _replace_top(qh, qb, nq, squares[b], b)
        else:
            nq -= 1
            if nq > 0:
                _replace_top(qh, qb, nq, qh[nq], qb[nq])
            if waiting == 0:
                kcur = int((low[1] + tolerance) // width)
            slot = int(s // width) % nb
            nxt[b] = head[slot]
            head[slot] = b
            waiting += 1
    return bins


@njit(cache=True)
def least_batches(xs, bound, limit):
    """GETLEASTBATCHES (OrchMLLM Algorithm 2) on ascending lengths ``xs``: the end index of
    each greedy batch with count * max <= ``bound``, at most ``limit`` batches (then the last
    end is below n: the bound is infeasible). A batch from i ends at the largest j with
    (j - i) * xs[j - 1] <= bound, a non-decreasing function of j: bisection below the upper
    bound i + bound // xs[i]."""
    n = xs.size
    ends = np.empty(min(n, limit), np.int64)
    i, k = 0, 0
    while i < n and k < limit:
        xi = xs[i]
        u = n if xi <= 0 else i + int(bound // xi)
        if u > n:
            u = n
        elif u <= i:
            u = i + 1
        if (u - i) * xs[u - 1] > bound:  # the largest feasible j in [i + 1, u)
            lo, hi = i + 1, u - 1
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if (mid - i) * xs[mid - 1] <= bound:
                    lo = mid
                else:
                    hi = mid - 1
            u = lo
        ends[k] = u
        i = u
        k += 1
    return ends[:k]

