"""OrchMLLM Appendix A, Algorithm 4 on whole lengths (token counts): the same batches as
the float kernel (`kernels.sum_square_heap`), with integer sums making each per-sample
step O(1) or small (numba, no JAX).

* the order, the picks and the grouping: `lpt_int` (lengths counted per value, placed
  longest first, ties by index; each pick records its place in its batch);
* the least sum: a count of bins per sum value; it only rises, so it walks up the counts;
* bins outside the window: a list per sum value; when the bound rises, the lists it passes
  enter the window whole (no bin is checked twice);
* the window: a min-tree over the bins (leaves: int64 keys (square-sum << k) | bin, one
  compare orders by (square-sum, index); +inf for a bin outside the window): the root is
  the receiver, and its update is one leaf-to-root path whose loads do not wait on each
  other (a heap's sift-down picks each level's child from the last);

Every sum lies in [least, least + tolerance + longest): the per-sum arrays are cyclic, a
power of two above that span long. Exact while sums and square-sums are exact in float64;
there the bound least + tolerance is the float kernel's very float, and a whole sum is
below it iff below its ceiling.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from mmjax.data.balance.lpt_int import group, pick_bits, value_counts, whole_stats

_MAX_SPAN = 1 << 22  # longest per-sum arrays (16 MiB each); wider spans take the float kernel


@njit(cache=True)
def _assign(many, tolerance, w, k, picks, counts):
    """Algorithm 4 on whole lengths in decreasing order (``many`` of each, from
    `lpt_int.value_counts`): fill ``picks`` with each one's (place in its batch << k) | batch
    (2^k >= d batches) and ``counts`` (zeros) with the count per batch; ``w``: the length
    of the cyclic per-sum arrays."""
    d = counts.size
    bmask, wmask = (1 << k) - 1, w - 1
    size = 1
    while size < d:
        size *= 2
    inf = np.int64(0x7FFFFFFFFFFFFFFF)
    tree = np.full(2 * size, inf, np.int64)  # the window: leaf size + b, node = min of two
    for b in range(d):
        tree[size + b] = b  # square-sum 0
    for i in range(size - 1, 0, -1):
        tree[i] = min(tree[2 * i], tree[2 * i + 1])
    sums = np.zeros(d, np.int64)
    keys = np.arange(d, dtype=np.int64)  # a waiting bin's key
    count = np.zeros(w, np.int32)  # bins per sum value (cyclic)
    count[0] = d
    head = np.full(w, -1, np.int32)  # per sum value, its first waiting bin (-1: none)
    nxt = np.empty(d, np.int32)  # the next waiting bin of the same sum
    least, waiting = 0, 0
    bound = np.int64(np.ceil(least + tolerance))  # a whole sum is in the window iff < bound
    t = 0
    for v in range(many.size - 1, -1, -1):
        square = (v * v) << k
        for _ in range(many[v]):
            key = tree[1]
            b = key & bmask
            picks[t] = (counts[b] << k) | b
            counts[b] += 1
            t += 1
            s0 = sums[b]
            s = s0 + v
            sums[b] = s
            count[s0 & wmask] -= 1
            count[s & wmask] += 1
            new_bound = bound
            if s0 == least and count[s0 & wmask] == 0:
                least += 1
                while count[least & wmask] == 0:
                    least += 1
                new_bound = np.int64(np.ceil(least + tolerance))
            key += square
            leaf = key  # still in the window, with its new square-sum
            if s >= new_bound:  # it waits at its sum
                leaf = inf
                keys[b] = key
                nxt[b] = head[s & wmask]
                head[s & wmask] = b
                waiting += 1
            i = size + b
            tree[i] = leaf
            while i > 1:
                leaf = min(leaf, tree[i ^ 1])
                i >>= 1
                tree[i] = leaf
            if new_bound > bound:  # the waiting bins it passes enter the window
                for u in range(bound, new_bound if waiting > 0 else bound):
                    c = head[u & wmask]
                    head[u & wmask] = -1
                    while c >= 0:
                        key = keys[c]
                        i = size + c
                        tree[i] = key
                        i >>= 1
                        while i >= 1 and tree[i] > key:
                            tree[i] = key
                            i >>= 1
                        waiting -= 1
                        c = nxt[c]
                bound = new_bound


def sum_square_int(x: np.ndarray, d: int,
                   tolerance: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Algorithm 4 on lengths ``x``: (items batch after batch, count per batch), as
    `lpt._group` gives them; None where this path does not apply: lengths not whole, sums
    or keys past exact float64 / int64, a tolerance below 2^-8 (least + tolerance must
    exceed least in float64) or a span past `_MAX_SPAN`."""
    top, total, total2 = whole_stats(x)
    n = x.size
    k, dtype = pick_bits(n, d)
    if (top < 0 or n >= 2 ** 31 or total >= 2.0 ** 40 or tolerance < 2.0 ** -8
            or total2 >= min(2.0 ** 52, 2.0 ** (61 - k))):
        return None
    tolerance = min(tolerance, total + 1.0)  # larger: every bin always in the window
    span = math.ceil(tolerance) + int(top) + 2
    if span > _MAX_SPAN:
        return None
    picks: np.ndarray = np.empty(n, dtype)
    counts = np.zeros(d, np.int64)
    many = value_counts(x, int(top))
    _assign(many, tolerance, 1 << (span - 1).bit_length(), k, picks, counts)
    return group(x, many, picks, k, counts), counts
