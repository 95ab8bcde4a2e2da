"""OrchMLLM Algorithm 2 ("padded" post-balancing, cost count x max): binary search on the
padded bound with greedy packing of the sorted lengths."""
from __future__ import annotations

import bisect
import math

import numpy as np

from mmjax.data.balance.lpt import _ascending


def _least_batches(xs: list[float], bound: float, limit: int) -> list[int] | None:
    """GETLEASTBATCHES (Algorithm 2) on ascending ``xs``: end index of each greedy batch with
    count * max <= bound, or None as soon as more than ``limit`` batches are needed.

    A batch starting at i holds at most bound // xs[i] items (later items are no shorter),
    so we jump there and bisect back only when the jump overshoots.
    """
    ends: list[int] = []
    i, n, count = 0, len(xs), 0
    while i < n:
        if count == limit:
            return None
        xi = xs[i]
        j = n if xi <= 0 else i + int(bound // xi)
        if j > n:
            j = n
        elif j <= i:
            j = i + 1
        if (j - i) * xs[j - 1] > bound:
            j = i + bisect.bisect_right(range(i + 1, j + 1), bound,
                                        key=lambda e: (e - i) * xs[e - 1])
        ends.append(j)
        count += 1
        i = j
    return ends


def _padded(x: np.ndarray, d: int) -> list[list[int]]:
    """Algorithm 2: binary search the smallest padded bound that fits in d batches.

    Some optimal partition is contiguous in sorted order (give the batch with the k-th
    smallest max the next-smallest items; no max grows), and packing sorted items greedily
    decides feasibility for a bound, so with integer lengths this is exactly optimal.
    Deviation: the paper's bracket [l_min, l_min * (n/d + 1)] need not contain the answer; we
    start at the lower bound max(l_max, ceil(sum / d)) and grow by 1/4 until feasible.
    """
    if np.any(x != np.round(x)):
        raise ValueError("policy 'padded' needs integer lengths (tokens per sample) for its "
                         "binary search; round the lengths")
    asc = _ascending(x)
    xs = x[asc].tolist()
    lo = max(int(x.max()), math.ceil(x.sum() / d), 1)
    hi = lo
    ends = _least_batches(xs, hi, d)
    while ends is None:  # grow by 1/4 until feasible
        lo, hi = hi + 1, hi + max(1, hi // 4)
        ends = _least_batches(xs, hi, d)
    while lo < hi:  # invariant: hi feasible (its packing in ends), everything < lo infeasible
        mid = (lo + hi) // 2
        packed = _least_batches(xs, mid, d)
        if packed is None:
            lo = mid + 1
        else:
            hi, ends = mid, packed
    order = asc.tolist()
    out = [order[s:e] for s, e in zip([0] + ends[:-1], ends)]
    return out + [[] for _ in range(d - len(out))]


# From this many ranks on "sum_square" runs in vectorised runs (`_sum_square_runs`); below,
