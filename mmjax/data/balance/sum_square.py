"""OrchMLLM Appendix A, Algorithm 4 ("sum_square" post-balancing): LPT whose near-lightest
batches compare by sum of squares."""
from __future__ import annotations

import numpy as np

from mmjax.data.balance.kernels import sum_square_heap
from mmjax.data.balance.lpt import _descending, _greedy, _group, _lists
from mmjax.data.balance.sum_square_int import sum_square_int


def _sum_square(x: np.ndarray, d: int, tolerance: float) -> list[list[int]]:
    """`_sum_square_flat` as one list of sample indices per batch."""
    return _lists(*_sum_square_flat(x, d, tolerance))


def _sum_square_flat(x: np.ndarray, d: int, tolerance: float,
                     whole: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 4: like Algorithm 1, but batches whose sums are within ``tolerance`` of the
    lightest compare by sum of squares (the comparator CMP, made a total order: the receiving
    batch is the one of least (square-sum, index) among those with sum < min sum + tolerance).
    O(n log d): bins wait by sum until they enter the window (the minimum only grows, so a
    bin leaves the window only by receiving a sample, and then waits again); compiled, since
    each pick depends on the one before. Whole lengths (token counts) take
    `sum_square_int.sum_square_int` (integer sums, counting sorts); others, or ``whole``
    False, the float kernel `kernels.sum_square_heap`: the same batches."""
    if tolerance <= 0:
        return _greedy(x, d)
    out = sum_square_int(x, d, tolerance) if whole else None
    if out is not None:
        return out
    desc = _descending(x)
    bins = sum_square_heap(np.ascontiguousarray(x[desc]), d, float(tolerance))
    return _group(bins, desc, d)
