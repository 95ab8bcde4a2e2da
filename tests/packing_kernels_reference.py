"""The frozen first-fit-decreasing count kernel before issue 41's per-group radix sort
(a counting sort of every group at once, then a float scan), kept as the reference the
compiled `mmjax.data.packing_kernels.first_fit_decreasing_buffers` must equal
(tests/test_packing_fast.py). Do not edit."""
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


@njit(cache=True)
def _decreasing_order(runs, ends):
    """Item indices group after group, each group's by run decreasing, ties by index: two
    stable counting sorts (by run decreasing, then by group), O(items + largest run);
    per-group stable argsorts when the runs are large next to the item count."""
    n = runs.size
    order = np.empty(n, np.int64)
    top = 0
    for i in range(n):
        top = max(top, runs[i])
    if top > 8 * n + 4096:
        start = 0
        for g in range(ends.size):
            order[start:ends[g]] = start + np.argsort(-runs[start:ends[g]], kind="mergesort")
            start = ends[g]
        return order
    at = np.zeros(top + 2, np.int64)  # by run decreasing: key top - run
    for i in range(n):
        at[top - runs[i] + 1] += 1
    for v in range(1, top + 2):
        at[v] += at[v - 1]
    by_run = np.empty(n, np.int64)
    for i in range(n):
        k = top - runs[i]
        by_run[at[k]] = i
        at[k] += 1
    group = np.empty(n, np.int64)
    nxt = np.empty(ends.size, np.int64)  # next free slot of each group in `order`
    start = 0
    for g in range(ends.size):
        group[start:ends[g]] = g
        nxt[g] = start
        start = ends[g]
    for i in by_run:
        g = group[i]
        order[nxt[g]] = i
        nxt[g] += 1
    return order


SCAN_BINS = 48  # up to this many bins a linear scan beats the tree


@njit(cache=True)
def _first_fit_scan(runs, order, start, end, cap, max_items, free, items):
    """Bins first fit opens for `runs[order[start:end]]` by scanning the open bins left to
    right (few bins: faster than the tree); `free`, `items`: scratch buffers."""
    bins = 0
    for k in range(start, end):
        need = runs[order[k]]
        b = 0
        while b < bins and free[b] < need:
            b += 1
        if b == bins:
            free[b] = cap
            items[b] = 0
            bins += 1
        free[b] -= need
        items[b] += 1
        if max_items >= 0 and items[b] >= max_items:
            free[b] = -np.inf
    return bins


@njit(cache=True)
def first_fit_decreasing_buffers(runs, ends, cap, max_items):
    """Buffers first fit decreasing (ties by order) opens per group, at most `max_items`
    images per buffer (< 0: no cap) (`pack_images`; LLM rows `pack_rows` "pack"): int64
    [groups]. One sort for every group (`_decreasing_order`), one tree and item-count
    buffer reused by every group, each sized to the group's bound on bins (`_bins_bound`),
    not its item count. Equal items come in runs: first fit puts the next one in the bin
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
    order = _decreasing_order(runs, ends)
    start = 0
    for g in range(ends.size):
        end = ends[g]
        if end == start:
            continue
        m = _bins_bound(runs, start, end, cap, max_items)
        if m <= SCAN_BINS:
            out[g] = _first_fit_scan(runs, order, start, end, cap, max_items, tree, items)
            start = end
            continue
        size = _reset(tree, m, float(cap))
        items[:m] = 0
        bins = 0
        k = start
        while k < end:  # a run of equal items: each bin found takes as many as fit
            need = runs[order[k]]
            e = k + 1
            while e < end and runs[order[e]] == need:
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
