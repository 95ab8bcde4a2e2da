"""OrchMLLM Appendix A, Algorithm 5 ("conv" post-balancing: padded attention)."""
from __future__ import annotations

import numpy as np

from mmjax.data.balance.lpt import _descending, _lpt_assign, _place


def _conv(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 5 (ConvTransformer: padded attention, cost L + lambda * b * max^2).

    Phase 1: descending lengths packed into batches whose padded size (count * first length)
    stays within Algorithm 1's objective, at most d batches (groups similar lengths, so
    little padding). Phase 2: the remaining lengths go greedily to the batch of least sum.
    Deviation: the paper tests ``(count + 1) * s.length``; the padded size of a descending
    batch is set by its first (longest) element, which is what we use. Returns
    (samples batch after batch, count per batch).
    """
    desc = _descending(x)
    lpt_loads = np.zeros(d)
    _lpt_assign(x, lpt_loads, desc)
    bound = float(lpt_loads.max())
    xs = x[desc]
    n = x.size
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(xs > 0, np.floor_divide(bound, xs), n)  # zero lengths: all the rest
    jump = np.minimum(np.arange(1, n + 1) + np.maximum(step, 1.0) - 1, n).astype(np.int64)
    jm = memoryview(jump)  # next batch start per start: the chain is d lookups
    ends = []
    i = 0
    while i < n and len(ends) < d:
        i = jm[i]
        ends.append(i)
    sizes = np.diff(ends, prepend=0)
    bins, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    bins[:i] = np.repeat(np.arange(len(ends)), sizes)
    slots[:i] = np.arange(i) - np.repeat(np.array(ends) - sizes, sizes)
    loads = np.bincount(bins[:i], weights=xs[:i], minlength=d)
    counts = np.zeros(d, dtype=np.int64)
    counts[:len(ends)] = sizes
    bins[i:], slots[i:] = _lpt_assign(x, loads, desc[i:], counts)
    return _place(bins, slots, desc, counts)
