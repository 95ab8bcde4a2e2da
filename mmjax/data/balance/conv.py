"""OrchMLLM Appendix A, Algorithm 5 ("conv" post-balancing: padded attention)."""
from __future__ import annotations

import numpy as np

from mmjax.data.balance.lpt import _lpt_assign, _place, _sorted_by


def _conv(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 5 (ConvTransformer: padded attention, cost L + lambda * b * max^2).

    Phase 1: descending lengths packed into batches whose padded size (count * first length)
    stays within Algorithm 1's objective, at most d batches (groups similar lengths, so
    little padding). Phase 2: the remaining lengths go greedily to the batch of least sum.
    Deviation: the paper tests ``(count + 1) * s.length``; the padded size of a descending
    batch is set by its first (longest) element, which is what we use. Returns
    (samples batch after batch, count per batch).
    """
    desc, xs = _sorted_by(x, True)
    lpt_loads = np.zeros(d)
    _lpt_assign(x, lpt_loads, desc, xs=xs)
    bound = float(lpt_loads.max())
    n = x.size
    v = memoryview(xs)  # Python floats, no numpy scalar per step
    ends = []
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
