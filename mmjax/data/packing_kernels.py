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
def _tree(n, cap):
    size = 1
    while size < n:
        size *= 2
    tree = np.full(2 * size, -np.inf)
    tree[size:size + n] = cap
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    return tree, size


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
def first_fit_decreasing_buffers(runs, ends, cap, max_items):
    """Buffers first fit decreasing (ties by order) opens per group, at most `max_items`
    images per buffer (< 0: no cap) (`pack_images`; LLM rows `pack_rows` "pack"): int64
    [groups]."""
    out = np.zeros(ends.size, np.int64)
    start = 0
    for g in range(ends.size):
        end = ends[g]
        n = end - start
        order = np.argsort(-runs[start:end], kind="mergesort")  # stable: ties by order
        tree, size = _tree(n, float(cap))
        items = np.zeros(max(n, 1), np.int64)
        bins = 0
        for k in range(n):
            need = float(runs[start + order[k]])
            b = _find(tree, size, need)
            if b < 0 or b == bins:
                b = bins
                bins += 1
            items[b] += 1
            key = tree[size + b] - need
            if max_items >= 0 and items[b] >= max_items:
                key = -np.inf
            _set(tree, size, b, key)
        out[g] = bins
        start = end
    return out
