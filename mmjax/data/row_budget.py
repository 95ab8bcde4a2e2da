"""A fixed LLM row budget per global batch (`Loader.row_budget`, no JAX): a step takes, of
its window's usable candidates in stream order, the longest prefix whose LLM rows (first fit
decreasing, `batch_shapes.pack_rows`) stay within the budget, then each of up to `TAIL`
later candidates that still fits; the rest are left out, like the window's unused reserve.
Samples per step vary and the rows do not, so the run's one static shape is the budget and
the rows are ~0.95-0.99 real tokens (docs/packing.md). O(n log^2 n) per step."""
from __future__ import annotations

import numpy as np

from mmjax.data.packing_kernels import first_fit_decreasing_buffers

TAIL = 64  # candidates after the prefix tried one by one to fill the last rows' gaps


def _rows(lengths: np.ndarray, seq_len: int) -> int:
    if lengths.size == 0:
        return 0
    return int(first_fit_decreasing_buffers(lengths, np.array([lengths.size]), seq_len, -1)[0])


def _fits(lengths: np.ndarray, rows: int, seq_len: int) -> bool:
    tokens = int(lengths.sum())
    if tokens > rows * seq_len:
        return False
    if 2 * tokens <= (rows - 1) * seq_len:  # any first fit leaves at most one row half empty
        return True
    return _rows(lengths, seq_len) <= rows


def fill_rows(lengths, rows: int, seq_len: int) -> list[int]:
    """Indices (ascending) of the samples of LLM `lengths` (stream order) a step takes into
    `rows` rows of `seq_len` tokens: the longest fitting prefix (binary search; every prefix
    it keeps was checked to fit), then the next `TAIL` candidates one by one."""
    x = np.asarray(lengths, np.int64)
    lo, hi = 0, x.size  # x[:lo] fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(x[:mid], rows, seq_len):
            lo = mid
        else:
            hi = mid - 1
    taken = list(range(lo))
    for i in range(lo + 1, min(x.size, lo + 1 + TAIL)):
        if _fits(x[taken + [i]], rows, seq_len):
            taken.append(i)
    return taken
