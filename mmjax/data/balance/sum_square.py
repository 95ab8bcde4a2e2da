"""OrchMLLM Appendix A, Algorithm 4 ("sum_square" post-balancing): LPT whose near-lightest
batches compare by sum of squares."""
from __future__ import annotations

import heapq
import math

import numpy as np

from mmjax.data.balance.lpt import _descending, _flat, _greedy, _group, _lists

# the heap loop is as fast (the window of candidate batches holds only a few of them).
# Measured at 60 samples per rank: 256 ranks 33 / 33 ms, 512: 86 / 54, 2560: 637 / 138.
_SUM_SQUARE_RUNS_MIN_RANKS = 256


def _sum_square(x: np.ndarray, d: int, tolerance: float,
                runs_min_ranks: int = _SUM_SQUARE_RUNS_MIN_RANKS) -> list[list[int]]:
    """`_sum_square_flat` as one list of sample indices per batch."""
    return _lists(*_sum_square_flat(x, d, tolerance, runs_min_ranks))


def _sum_square_flat(x: np.ndarray, d: int, tolerance: float,
                     runs_min_ranks: int = _SUM_SQUARE_RUNS_MIN_RANKS
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 4: like Algorithm 1, but batches whose sums are within ``tolerance`` of the
    lightest compare by sum of squares (the comparator CMP, made a total order: the receiving
    batch is the one of least (square-sum, index) among those with sum < min sum + tolerance).

    Two exact implementations with identical output: a heap loop, O(n log d) (bins wait in a
    heap by sum until they enter the window; the minimum only grows, so a bin leaves the
    window only by receiving a sample, and then re-queues), and, from ``runs_min_ranks``
    ranks on, `_sum_square_runs` (numpy, whole runs of picks at a time).
    """
    if tolerance <= 0:
        return _greedy(x, d)
    if d >= runs_min_ranks:
        return _sum_square_runs(x, d, tolerance)
    sums, squares, version = [0.0] * d, [0.0] * d, [0] * d
    outside = [(0.0, i) for i in range(d)]  # (sum, bin), bins not in the window
    by_square: list[tuple[float, int, int]] = []  # (square-sum, bin, version), window bins
    by_sum: list[tuple[float, int, int]] = []  # (sum, bin, version), window bins
    out: list[list[int]] = [[] for _ in range(d)]
    desc = _descending(x).tolist()
    xs = x.tolist()
    push, pop = heapq.heappush, heapq.heappop
    for s in desc:
        while by_sum and by_sum[0][2] != version[by_sum[0][1]]:
            pop(by_sum)
        low = min(by_sum[0][0] if by_sum else math.inf, outside[0][0] if outside else math.inf)
        bound = low + tolerance
        while outside and outside[0][0] < bound:
            total, b = pop(outside)
            push(by_square, (squares[b], b, version[b]))
            push(by_sum, (total, b, version[b]))
        while by_square[0][2] != version[by_square[0][1]]:
            pop(by_square)
        b = pop(by_square)[1]
        out[b].append(s)
        v = xs[s]
        sums[b] += v
        squares[b] += v * v
        version[b] += 1
        push(outside, (sums[b], b))
    return _flat(out)


def _run_length(sums, squares, in_window, ranked, xc, tol) -> int:
    """How many of the next picks of Algorithm 4 go to ``ranked[0], ranked[1], ...`` in turn.

    ``ranked``: the window's batches by (square-sum, index); ``xc``: the next lengths. Pick
    ``t`` goes to ``ranked[t]`` unless by then (b) a batch entered the window (the minimum sum
    rose) or (c) a batch served earlier in this run is back in the window, with a key below
    ``ranked[t]``'s. Each such batch has a step from which it is in the window (the bound
    ``min sum + tol`` per step is a prefix/suffix minimum, non-decreasing) and a step from
    which its key is below ``ranked[t]``'s (a binary search in the sorted square-sums; equal
    square-sums count as below, which can only end a run early); the run ends at the first
    step where both hold for some batch. Always >= 1 (the first pick is the window minimum).
    """
    k = xc.size
    s_r = sums[ranked]
    ns = s_r + xc  # sums after the pick
    pre = np.minimum.accumulate(ns)
    low = np.minimum.accumulate(s_r[::-1])[::-1]
    np.minimum(low[1:], pre[:-1], out=low[1:])
    rest = ~in_window
    m_rest = sums[rest].min() if ranked.size < sums.size else math.inf
    thr = np.minimum(low[1:], m_rest) + tol  # window bound before picks 1 .. k-1
    t_max = thr[-1]
    q_r = squares[ranked]
    fail = k
    if m_rest < t_max:  # (b) batches entering the window
        enter = np.flatnonzero(rest & (sums < t_max))
        due = np.maximum(np.searchsorted(thr, sums[enter], side="right") + 1,
                         np.searchsorted(q_r, squares[enter], side="left"))
        fail = min(fail, int(due.min()))
    if fail > 1 and pre[fail - 2] < thr[fail - 2]:  # (c) a served batch may be due again
        j = fail - 1  # served at 0 .. j-1
        back = np.maximum(np.searchsorted(thr, ns[:j], side="right") + 1, np.arange(1, j + 1))
        due = np.maximum(back, np.searchsorted(q_r, q_r[:j] + xc[:j] * xc[:j], side="left"))
        fail = min(fail, int(due.min()))
    return fail


def _sum_square_runs(x: np.ndarray, d: int, tolerance: float) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 4 in numpy: take the window (sum < min + tolerance) ranked by (square-sum,
    index) and give it the next lengths in order for as long as that provably is what the
    one-at-a-time rule does (`_run_length`); repeat. Same output as the heap loop (tests
    compare both with the literal scan); runs are up to |window| picks long (~150 on
    average at 2560 ranks x 60 LAION-like samples), so a run costs ~20 numpy calls instead
    of ~150 heap operations."""
    desc = _descending(x)
    xs = x[desc]
    n = xs.size
    sums, squares = np.zeros(d), np.zeros(d)
    bins = np.empty(n, dtype=np.int64)
    i = 0
    while i < n:
        in_window = sums < sums.min() + tolerance
        cand = np.flatnonzero(in_window)
        ranked = cand[np.argsort(squares[cand], kind="stable")]
        xc = xs[i:i + ranked.size]
        if xc.size < ranked.size:  # the last samples: the rest of the window waits
            ranked = ranked[:xc.size]
            in_window = np.zeros(d, dtype=bool)
            in_window[ranked] = True
        r = 1 if xc.size == 1 else _run_length(sums, squares, in_window, ranked, xc, tolerance)
        chosen = ranked[:r]
        bins[i:i + r] = chosen
        sums[chosen] += xc[:r]
        squares[chosen] += xc[:r] * xc[:r]
        i += r
    return _group(bins, desc, d)
