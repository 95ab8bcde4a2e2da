"""Compiled first-fit-decreasing packing counts over many groups at once (numba, no JAX):
how many rows / buffers `batch_shapes.pack_rows` ("pack") and `pack_images` open for each
group, for every DP rank of a unit in one call. The same leftmost-fit max segment tree as
`batch_shapes.LeftmostFit` (O(n log n) per group), so the counts are exactly those of the
Python packers (tests/test_packing_fast.py). Groups are consecutive slices of one flat
array: group g is `x[ends[g - 1]:ends[g]]`.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def _reset(tree, n, cap):
    """Make `tree` (reused across groups) a max tree over `n` bins at `cap`: the smallest
    power of two >= n leaves (the rest -inf); returns that leaf count."""
    size = 1
    while size < n:
        size *= 2
    tree[size:size + n] = cap
    tree[size + n:2 * size] = -np.inf
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    return size


@njit(cache=True)
def _bins_bound(runs, start, end, cap, max_items):
    """At most this many bins open for `runs[start:end]`: every bin but one is more than
    half full or holds `max_items` items (a second bin at most half full and below its
    item cap would have taken the first item of the later one), so bins <= 2 sum / cap + 1
    + n / max_items; never more than n."""
    n = end - start
    if cap <= 0 or max_items == 0:
        return max(n, 1)
    total = 0
    for i in range(start, end):
        total += runs[i]
    bound = 2 * total // cap + 2
    if max_items > 0:
        bound += n // max_items
    return max(min(bound, n), 1)


@njit(cache=True)
def _find(tree, size, need):
    if tree[1] < need:
        return -1
    i = 1
    while i < size:
        i *= 2
        if tree[i] < need:
            i += 1
    return i - size


@njit(cache=True)
def _set(tree, size, b, key):
    i = b + size
    tree[i] = key
    i //= 2
    while i:
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
        i //= 2


DIGIT = 6  # bits a radix pass sorts (64 buckets: a group of ~100 stays in L1)


@njit(cache=True)
def _sort_decreasing(runs, start, end, out, tmp, hist):
    """`out[:n]` = `runs[start:end]` sorted decreasing (n = end - start): LSD radix sort
    on `DIGIT`-bit digits of top - run, O(n) a pass; `np.sort` past three passes. Only
    the values: first fit's bin counts depend on the sequence of sizes alone (equal items
    are interchangeable), so no index is carried."""
    n = end - start
    if n == 0:
        return
    top = runs[start]
    low = runs[start]
    for i in range(n):
        v = runs[start + i]
        out[i] = v
        top = max(top, v)
        low = min(low, v)
    passes = 0
    span = top - low
    while span > 0:
        span >>= DIGIT
        passes += 1
    if passes > 3:
        s = np.sort(out[:n])
        for i in range(n):
            out[i] = s[n - 1 - i]
        return
    mask = (1 << DIGIT) - 1
    src, dst = out, tmp
    for p in range(passes):
        shift = p * DIGIT
        hist[:] = 0
        for i in range(n):
            hist[((top - src[i]) >> shift) & mask] += 1
        acc = 0
        for d in range(mask + 1):
            c = hist[d]
            hist[d] = acc
            acc += c
        for i in range(n):
            d = ((top - src[i]) >> shift) & mask
            dst[hist[d]] = src[i]
            hist[d] += 1
        src, dst = dst, src
    if passes % 2:
        out[:n] = tmp[:n]


SCAN_BINS = 48  # up to this many bins a linear scan beats the tree
FULL = -(1 << 62)  # the scan's free room of a bin that takes no more items


@njit(cache=True)
def _first_fit_scan(vals, n, cap, max_items, free, items):
    """Bins first fit opens for `vals[:n]` (decreasing) by scanning the open bins left to
    right (few bins: faster than the tree); `free`, `items`: scratch buffers. An item over
    half a bin opens one without a scan: every open bin holds one at least as large."""
    bins = 0
    for k in range(n):
        need = vals[k]
        b = 0
        if 2 * need <= cap:
            while b < bins and free[b] < need:
                b += 1
        else:
            b = bins
        if b == bins:
            free[b] = cap
            items[b] = 0
            bins += 1
        free[b] -= need
        items[b] += 1
        if max_items >= 0 and items[b] >= max_items:
            free[b] = FULL
    return bins


@njit(cache=True)
def first_fit_decreasing_buffers(runs, ends, cap, max_items):
    """Buffers first fit decreasing (ties by order) opens per group, at most `max_items`
    images per buffer (< 0: no cap) (`pack_images`; LLM rows `pack_rows` "pack"): int64
    [groups]. Each group's sizes sorted in place (`_sort_decreasing`), one tree and
    item-count buffer reused by every group, each sized to the group's bound on bins
    (`_bins_bound`), not its item count. Equal items come in runs: first fit puts the next one in the bin
    that took the last while it fits (the bins left of it had less room), so each bin
    found takes as many of the run as fit, one tree update for them all."""
    out = np.zeros(ends.size, np.int64)
    width = 1
    start = 0
    for g in range(ends.size):
        width = max(width, _bins_bound(runs, start, ends[g], cap, max_items))
        start = ends[g]
    size = 1
    while size < width:
        size *= 2
    tree = np.empty(max(2 * size, SCAN_BINS))
    items = np.zeros(max(width, SCAN_BINS), np.int64)
    longest = 0
    start = 0
    for g in range(ends.size):
        longest = max(longest, ends[g] - start)
        start = ends[g]
    vals = np.empty(longest, np.int64)
    tmp = np.empty(longest, np.int64)
    hist = np.empty(1 << DIGIT, np.int64)
    room = np.empty(SCAN_BINS, np.int64)
    start = 0
    for g in range(ends.size):
        end = ends[g]
        if end == start:
            continue
        m = _bins_bound(runs, start, end, cap, max_items)
        _sort_decreasing(runs, start, end, vals, tmp, hist)
        n = end - start
        if m <= SCAN_BINS:
            out[g] = _first_fit_scan(vals, n, cap, max_items, room, items)
            start = end
            continue
        size = _reset(tree, m, float(cap))
        items[:m] = 0
        bins = 0
        k = 0
        while k < n:  # a run of equal items: each bin found takes as many as fit
            need = vals[k]
            e = k + 1
            while e < n and vals[e] == need:
                e += 1
            left = e - k
            while left:
                b = _find(tree, size, float(need))
                if b < 0 or b == bins:
                    b = bins
                    bins += 1
                    if bins > m:
                        raise ValueError("first fit opened more bins than its bound")
                free = int(tree[size + b])
                if need == 0:
                    take = left
                elif free < need:  # longer than a fresh bin: one alone, over its cap
                    take = 1
                else:
                    take = min(left, free // need)
                if max_items >= 0:  # a fresh bin takes one even at an item cap of 0
                    take = max(min(take, max_items - items[b]), 1)
                items[b] += take
                left -= take
                key = float(free - take * need)
                if max_items >= 0 and items[b] >= max_items:
                    key = -np.inf
                _set(tree, size, b, key)
            k = e
        out[g] = bins
        start = end
    return out
