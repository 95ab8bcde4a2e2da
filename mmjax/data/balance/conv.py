"""OrchMLLM Appendix A, Algorithm 5 ("conv" post-balancing: padded attention)."""
from __future__ import annotations

import numpy as np

from mmjax.data.balance.lpt import _descending, _group, _lpt_assign


def _conv(x: np.ndarray, d: int) -> list[list[int]]:
    """Algorithm 5 (ConvTransformer: padded attention, cost L + lambda * b * max^2).

    Phase 1: descending lengths packed into batches whose padded size (count * first length)
    stays within Algorithm 1's objective, at most d batches (groups similar lengths, so
    little padding). Phase 2: the remaining lengths go greedily to the batch of least sum.
    Deviation: the paper tests ``(count + 1) * s.length``; the padded size of a descending
    batch is set by its first (longest) element, which is what we use.
    """
    desc = _descending(x)
    lpt_loads = np.zeros(d)
    _lpt_assign(x, lpt_loads, desc)
    bound = float(lpt_loads.max())
    xs = x[desc]
    bins = np.empty(x.size, dtype=np.int64)
    i = k = 0
    while i < x.size and k < d:
        j = x.size if xs[i] <= 0 else min(x.size, i + max(1, int(bound // xs[i])))
        bins[i:j] = k
        i, k = j, k + 1
    loads = np.bincount(bins[:i], weights=xs[:i], minlength=d)
    bins[i:] = _lpt_assign(x, loads, desc[i:])
    return _group(bins, desc, d)
