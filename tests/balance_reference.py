"""The post-balancing policies as they were before the vectorised rewrite (a frozen copy of
mmjax/data/balance.py at 615e7f3): the reference the tests compare the new code with, output
for output, and the "before" column of scripts/bench_balance.py."""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Sequence

import numpy as np


POLICIES = ("sum", "padded", "sum_square", "conv")


def _as_lengths(lengths: Sequence[float], name: str) -> np.ndarray:
    x = np.asarray(lengths, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be a flat sequence of per-sample lengths, "
                         f"got shape {x.shape}")
    if x.size and (not np.all(np.isfinite(x)) or x.min() < 0):
        raise ValueError(f"{name} must be finite and >= 0 (tokens per sample)")
    return x


def _check_ranks(num_ranks: int, name: str = "num_ranks") -> None:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, (int, np.integer)) or num_ranks < 1:
        raise ValueError(f"{name} must be a positive int (the DP size), got {num_ranks!r}")


def _lpt_assign(x: np.ndarray, loads: np.ndarray, items: np.ndarray) -> np.ndarray:
    """Greedy: ``items`` (in the given order) each to the bin of least (load, index).

    Returns the bin of each item and updates ``loads`` in place. Exactly the heap algorithm,
    vectorised: a chunk of items takes the next-lightest bins in order as long as none of them
    would rather go to a bin already filled in this chunk (checked per item, so results match
    the heap loop bit for bit); each chunk is usually a whole round of ``d`` items.
    """
    d = loads.size
    bins = np.empty(items.size, dtype=np.int64)
    ranked = np.argsort(loads, kind="stable")
    i = 0
    while i < items.size:
        m = min(d, items.size - i)
        xc = x[items[i:i + m]]
        f = loads[ranked[:m]]
        r = 1
        if m > 1:
            ok = f[1:] < np.minimum.accumulate(f + xc)[:-1]
            r = m if ok.all() else 1 + int(np.argmin(ok))
        chosen = ranked[:r]
        bins[i:i + r] = chosen
        loads[chosen] += xc[:r]
        ranked = np.argsort(loads, kind="stable")
        i += r
    return bins


def _small_ints(x: np.ndarray) -> bool:
    return bool(x.size) and x.max() < 65536 and bool(np.all(x == np.floor(x)))


def _descending(x: np.ndarray) -> np.ndarray:
    """Indices by decreasing length, ties by increasing index (radix sort for token counts)."""
    if _small_ints(x):
        return np.argsort((65535 - x).astype(np.uint16), kind="stable")
    return np.argsort(-x, kind="stable")


def _ascending(x: np.ndarray) -> np.ndarray:
    if _small_ints(x):
        return np.argsort(x.astype(np.uint16), kind="stable")
    return np.argsort(x, kind="stable")


def _group(bins: np.ndarray, items: np.ndarray, d: int) -> list[list[int]]:
    """Items per bin, keeping their order (vectorised: the lists are built in one pass)."""
    keys = bins.astype(np.uint16) if d <= 65536 else bins
    flat = items[np.argsort(keys, kind="stable")].tolist()
    ends = np.cumsum(np.bincount(bins, minlength=d)).tolist()
    return [flat[s:e] for s, e in zip([0] + ends[:-1], ends)]


def greedy_partition(sizes: Sequence[float], num_bins: int,
                     name: str = "lengths") -> list[list[int]]:
    """LPT greedy number partitioning: largest first, each to the lightest bin (4/3 - 1/(3d)).

    OrchMLLM Algorithm 1 and DistTrain Algorithm 2 (see ``reorder.intra_reorder``). Returns
    sample indices per bin, in assignment order (descending size).
    """
    _check_ranks(num_bins, "num_bins")
    x = _as_lengths(sizes, name)
    items = _descending(x)
    return _group(_lpt_assign(x, np.zeros(int(num_bins)), items), items, int(num_bins))


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
# the heap loop is as fast (the window of candidate batches holds only a few of them).
# Measured at 60 samples per rank: 256 ranks 33 / 33 ms, 512: 86 / 54, 2560: 637 / 138.
_SUM_SQUARE_RUNS_MIN_RANKS = 256


def _sum_square(x: np.ndarray, d: int, tolerance: float,
                runs_min_ranks: int = _SUM_SQUARE_RUNS_MIN_RANKS) -> list[list[int]]:
    """Algorithm 4: like Algorithm 1, but batches whose sums are within ``tolerance`` of the
    lightest compare by sum of squares (the comparator CMP, made a total order: the receiving
    batch is the one of least (square-sum, index) among those with sum < min sum + tolerance).

    Two exact implementations with identical output: a heap loop, O(n log d) (bins wait in a
    heap by sum until they enter the window; the minimum only grows, so a bin leaves the
    window only by receiving a sample, and then re-queues), and, from ``runs_min_ranks``
    ranks on, `_sum_square_runs` (numpy, whole runs of picks at a time).
    """
    if tolerance <= 0:
        return greedy_partition(x, d)
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
    return out


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


def _sum_square_runs(x: np.ndarray, d: int, tolerance: float) -> list[list[int]]:
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


def post_balance(lengths: Sequence[float], num_ranks: int, policy: str = "sum", *,
                 tolerance: float | None = None) -> list[list[int]]:
    """Batch post-balancing (OrchMLLM §5.1 and Appendix A): sample indices per new mini-batch.

    ``lengths``: per-sample length in tokens for one phase (an encoder's input tokens, or the
    whole interleaved sequence for the LLM, §6 "Subsequences assembly"). ``policy``:
    "sum" (no padding, Algorithm 1, LPT, 4/3-approximate), "padded" (padding, cost
    count * max, Algorithm 2, binary search + greedy), "sum_square" (no padding with a
    non-negligible attention term, Algorithm 4; ``tolerance`` in tokens, default the mean
    length; 0 gives Algorithm 1), "conv" (padded attention, Algorithm 5).
    Returns exactly ``num_ranks`` lists (some may be empty); every sample appears once.
    Leave out samples that have no data for the phase (length 0): an encoder's dispatcher
    only sees samples with its modality, and zero lengths all land on one lightest batch.
    """
    _check_ranks(num_ranks)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    x = _as_lengths(lengths, "lengths")
    d = int(num_ranks)
    if x.size == 0:
        return [[] for _ in range(d)]
    if policy == "sum":
        return greedy_partition(x, d)
    if policy == "padded":
        return _padded(x, d)
    if policy == "sum_square":
        tol = float(x.mean()) if tolerance is None else float(tolerance)
        if not math.isfinite(tol) or tol < 0:
            raise ValueError(f"tolerance must be finite and >= 0 tokens, got {tolerance!r}")
        return _sum_square(x, d, tol)
    return _conv(x, d)
