"""OrchMLLM batch post-balancing (OrchMLLM §5) and rearrangement composition (§6).

* ``post_balance(lengths, num_ranks, policy)``: rearrange the examples of all DP instances'
  mini-batches into ``num_ranks`` new mini-batches minimising the largest cost (§5.1, Eq. 1-2):
  "sum" (Algorithm 1), "padded" (Algorithm 2), "sum_square" (Appendix A, Algorithm 4),
  "conv" (Appendix A, Algorithm 5). ``batch_cost`` is the matching per-batch cost.
* ``node_wise_rearrange``: Algorithm 3 (§5.2.2), permute the new mini-batches over ranks so the
  largest per-rank inter-node all-to-all volume (Eq. 5) is minimal; ``inter_node_volumes``
  measures it.
* ``Rearrangement`` / ``compose_rearrangement``: where every example moves, (rank, slot) ->
  (rank, slot); per encoder the single map Pi_M o Pi_E^-1 from the encoder's balanced batches
  to the LLM rank that consumes its output (§6, "Rearrangement composition").

Pure host code (numpy, highspy); no JAX. Every host runs it on the all-gathered lengths and gets
the same answer (§5.2.1), so all algorithms are deterministic: ties go to the lower index.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from mmjax.data.node_milp import milp_nodes

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


def batch_cost(batch_lengths: Sequence[float], policy: str = "sum", lam: float = 0.0) -> float:
    """Cost of one mini-batch (OrchMLLM Eq. 1-2, Appendix A), in units of alpha.

    "sum": sum l; "padded": count * max l; "sum_square": sum l + lam * sum l^2;
    "conv": sum l + lam * count * (max l)^2, with lam = beta / alpha.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    x = _as_lengths(batch_lengths, "batch_lengths")
    if x.size == 0:
        return 0.0
    if policy == "sum":
        return float(x.sum())
    if policy == "padded":
        return float(x.size * x.max())
    if policy == "sum_square":
        return float(x.sum() + lam * (x * x).sum())
    return float(x.sum() + lam * x.size * x.max() ** 2)


# ---------------------------------------------------------------- node-wise rearrangement


def _per_sample(src_rank_of_sample, new_batches, sizes, ranks_per_node):
    """Validated per-sample arrays: source rank, new batch, volume; and d."""
    src = np.asarray(src_rank_of_sample, dtype=np.int64)
    w = _as_lengths(sizes, "sizes")
    d = len(new_batches)
    _check_ranks(ranks_per_node, "ranks_per_node")
    if d == 0 or d % ranks_per_node:
        raise ValueError(f"the number of new batches ({d}) must be a positive multiple of "
                         f"ranks_per_node ({ranks_per_node})")
    if src.shape != w.shape:
        raise ValueError(f"src_rank_of_sample ({src.size}) and sizes ({w.size}) must have one "
                         "entry per sample")
    if src.size and (src.min() < 0 or src.max() >= d):
        raise ValueError(f"src_rank_of_sample must be ranks in [0, {d})")
    lens = [len(b) for b in new_batches]
    flat = np.fromiter(itertools.chain.from_iterable(new_batches), dtype=np.int64,
                       count=sum(lens))
    if flat.size != src.size or (flat.size and (flat.min() < 0 or flat.max() >= src.size
                                                or np.bincount(flat).min() != 1)):
        raise ValueError("new_batches must hold every sample index exactly once")
    bat = np.empty(src.size, dtype=np.int64)
    bat[flat] = np.repeat(np.arange(d), lens)
    return src, bat, w, d


def volume_matrix(src_rank_of_sample, new_batches, sizes) -> np.ndarray:
    """V[r, i]: volume the source rank r sends to new batch i (Algorithm 3 lines 1-4)."""
    src, bat, w, d = _per_sample(src_rank_of_sample, new_batches, sizes, 1)
    return _volumes(src, bat, w, d)


def _volumes(src, bat, w, d) -> np.ndarray:
    return np.bincount(src * d + bat, weights=w, minlength=d * d).reshape(d, d)


def inter_node_volumes(src_rank_of_sample, dst_rank_of_sample, sizes,
                       ranks_per_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-rank inter-node (send, recv) volume of an all-to-all moving each sample (Eq. 5)."""
    _check_ranks(ranks_per_node, "ranks_per_node")
    src = np.asarray(src_rank_of_sample, dtype=np.int64)
    dst = np.asarray(dst_rank_of_sample, dtype=np.int64)
    w = _as_lengths(sizes, "sizes")
    if not (src.shape == dst.shape == w.shape):
        raise ValueError("src_rank_of_sample, dst_rank_of_sample and sizes need one entry "
                         "per sample")
    num = int(max(src.max(initial=-1), dst.max(initial=-1)) + 1)
    cross = (src // ranks_per_node) != (dst // ranks_per_node)
    send = np.bincount(src[cross], weights=w[cross], minlength=num)
    recv = np.bincount(dst[cross], weights=w[cross], minlength=num)
    return send, recv


def max_inter_node_volume(src_rank_of_sample, dst_rank_of_sample, sizes, ranks_per_node: int,
                          include_recv: bool = True) -> float:
    """max over ranks of inter-node send (and recv) volume: the all-to-all's straggler."""
    send, recv = inter_node_volumes(src_rank_of_sample, dst_rank_of_sample, sizes, ranks_per_node)
    return float(max(send.max(initial=0.0), recv.max(initial=0.0) if include_recv else 0.0))


def _objective(src, bat, w, d, node_of_batch, c, include_recv) -> float:
    cross = (src // c) != node_of_batch[bat]
    send = np.bincount(src[cross], weights=w[cross], minlength=d).max(initial=0.0)
    recv = np.bincount(bat[cross], weights=w[cross], minlength=d).max(initial=0.0)
    return float(max(send, recv if include_recv else 0.0))


def _greedy_nodes(src, bat, w, d, c) -> np.ndarray:
    """Fast path: batches to nodes by descending volume already on that node, c per node.

    O(n + k log k) for k non-zero (node, batch) volumes; batches with nothing to keep fill
    the free places in order.
    """
    nn = d // c
    nodecost = np.bincount((src // c) * d + bat, weights=w, minlength=nn * d)
    nz = np.flatnonzero(nodecost)
    nz = nz[np.argsort(-nodecost[nz], kind="stable")]
    nodes, batches = nz // d, nz % d
    node_of, free = np.full(d, -1), np.full(nn, c)
    owner, room = [-1] * d, [c] * nn  # the same state as Python lists for the scalar loop
    left, pos, chunk = d, 0, d
    while left and pos < nz.size:
        # entries whose batch is placed or whose node is full stay rejected: drop them in
        # bulk, then take the rest one by one in order
        nb, bb = nodes[pos:pos + chunk], batches[pos:pos + chunk]
        live = (node_of[bb] < 0) & (free[nb] > 0)
        pos, chunk = pos + chunk, 2 * chunk
        for n, b in zip(nb[live].tolist(), bb[live].tolist()):
            if owner[b] < 0 and room[n] > 0:
                owner[b] = n
                room[n] -= 1
                left -= 1
                if left == 0:
                    break
        node_of, free = np.array(owner), np.array(room)
    slots = np.repeat(np.arange(nn), free)
    node_of[node_of < 0] = slots
    return node_of


def node_wise_rearrange(src_rank_of_sample: Sequence[int], new_batches: Sequence[Sequence[int]],
                        sizes: Sequence[float], ranks_per_node: int, *, include_recv: bool = True,
                        method: str = "auto", time_limit: float = 0.5,
                        max_milp_ranks: int = 64, require_optimal: bool = False,
                        info: dict | None = None) -> list[int]:
    """Algorithm 3 (OrchMLLM §5.2.2): choose which rank receives each new mini-batch.

    Returns ``perm``: new batch i goes to rank ``perm[i]`` (ranks ``n*c .. n*c+c-1`` form node
    n). Minimises the largest per-rank inter-node volume: sends, as in the paper, and, with
    ``include_recv``, receives too. Only a batch's node matters for that objective; within a
    node a batch stays on its own index when it can (fewest moves), others fill the free
    ranks in order. ``method``: "milp" (the paper's ILP with HiGHS, stopped after
    ``time_limit`` seconds, keeping the incumbent), "greedy" (fast path: batches to nodes by
    descending volume already there, O(n + k log k), milliseconds at 2560 ranks), "auto"
    (MILP up to ``max_milp_ranks`` ranks, greedy above: the MILP has d^2/c binaries and dense
    volume matrices make HiGHS hit the time limit beyond a few dozen nodes). The best of the
    solver's answer, the greedy one and the identity is returned, so the result never has
    more inter-node volume than leaving batch i on rank i. ``require_optimal`` drops a MILP
    answer not proven optimal within the time limit (a time-limited incumbent depends on
    machine speed, so hosts that must agree on the plan would not). ``info`` (a dict, if
    given) receives "milp_status", "milp_bound" and "milp_gap" (when the MILP ran: HiGHS'
    proven lower bound and the answer's relative gap to it; the solve is warm-started from
    the greedy placement), "chosen" ("milp", "greedy" or
    "identity") and "objective" (per candidate, the max per-rank inter-node volume).
    """
    if method not in ("auto", "milp", "greedy"):
        raise ValueError(f"method must be 'auto', 'milp' or 'greedy', got {method!r}")
    src, bat, w, d = _per_sample(src_rank_of_sample, new_batches, sizes, ranks_per_node)
    c = int(ranks_per_node)
    identity = np.arange(d) // c
    info = {} if info is None else info
    greedy = _greedy_nodes(src, bat, w, d, c)
    names, candidates = ["identity", "greedy"], [identity, greedy]
    if method == "milp" or (method == "auto" and d <= max_milp_ranks):
        solved = milp_nodes(_volumes(src, bat, w, d), c, include_recv, time_limit, info,
                             greedy, _objective(src, bat, w, d, greedy, c, include_recv))
        if solved is not None and (info["milp_status"] == "optimal" or not require_optimal):
            names.insert(0, "milp")
            candidates.insert(0, solved)
    scores = [_objective(src, bat, w, d, cand, c, include_recv) for cand in candidates]
    best = int(np.argmin(scores))
    info["chosen"], info["objective"] = names[best], dict(zip(names, scores))
    node_of = candidates[best]
    perm = np.where(node_of == identity, np.arange(d), -1)
    taken = np.zeros(d, dtype=bool)
    taken[perm[perm >= 0]] = True
    # the other batches take their node's free ranks, lowest batch to lowest rank (each
    # node has exactly c batches, so movers and free ranks pair up node by node)
    movers = np.flatnonzero(perm < 0)
    movers = movers[np.argsort(node_of[movers], kind="stable")]
    perm[movers] = np.flatnonzero(~taken)  # free ranks, ascending: node by node
    return perm.tolist()


def batches_by_rank(new_batches: Sequence[Sequence[int]], perm: Sequence[int]) -> list[list[int]]:
    """Place new batch i on rank perm[i]: the per-rank batches after node-wise rearrangement."""
    if sorted(perm) != list(range(len(new_batches))):
        raise ValueError(f"perm must be a permutation of range({len(new_batches)})")
    out: list[list[int]] = [[] for _ in new_batches]
    for i, r in enumerate(perm):
        out[r] = list(new_batches[i])
    return out


# ---------------------------------------------------------------- rearrangement composition


@dataclass(frozen=True)
class Rearrangement:
    """Where each example moves: ``samples[k]`` goes from ``src[k]`` to ``dst[k]``.

    Positions are (rank, slot): slot = index in that rank's ordered list. This is the
    explicit form of a rearrangement Pi (OrchMLLM §5.1) and of the all-to-all that applies it.
    """

    samples: tuple[int, ...]
    src: tuple[tuple[int, int], ...]
    dst: tuple[tuple[int, int], ...]
    num_src_ranks: int
    num_dst_ranks: int

    def apply(self, per_rank: Sequence[Sequence]) -> list[list]:
        """Move per-rank payloads (in src slot order) to per-rank lists in dst slot order."""
        if len(per_rank) != self.num_src_ranks:
            raise ValueError(f"expected {self.num_src_ranks} source ranks, got {len(per_rank)}")
        sizes = [0] * self.num_dst_ranks
        for r, s in self.dst:
            sizes[r] = max(sizes[r], s + 1)
        out: list[list] = [[None] * n for n in sizes]
        for (sr, ss), (dr, ds) in zip(self.src, self.dst):
            out[dr][ds] = per_rank[sr][ss]
        return out

    def inverse(self) -> "Rearrangement":
        """Pi^-1 (e.g. gradients flowing back from the LLM to the encoder)."""
        return Rearrangement(self.samples, self.dst, self.src, self.num_dst_ranks,
                             self.num_src_ranks)

    def then(self, other: "Rearrangement") -> "Rearrangement":
        """``other o self``: first self, then other (other's src must be self's dst)."""
        by_pos = {pos: k for k, pos in enumerate(other.src)}
        dst = []
        for pos in self.dst:
            if pos not in by_pos:
                raise ValueError(f"position {pos} of the first rearrangement is not moved by "
                                 "the second")
            dst.append(other.dst[by_pos[pos]])
        return Rearrangement(self.samples, self.src, tuple(dst), self.num_src_ranks,
                             other.num_dst_ranks)

    def send_ranks(self) -> tuple[list[int], list[int]]:
        """(source rank, destination rank) per moved sample, for ``inter_node_volumes``."""
        return [r for r, _ in self.src], [r for r, _ in self.dst]


def rearrangement(src_batches: Sequence[Sequence[int]],
                  dst_batches: Sequence[Sequence[int]]) -> Rearrangement:
    """The rearrangement taking the samples of ``src_batches`` to their slots in ``dst_batches``.

    Both are per-rank ordered lists of sample ids holding the same samples once each.
    """
    where: dict[int, tuple[int, int]] = {}
    for r, batch in enumerate(dst_batches):
        for slot, s in enumerate(batch):
            if s in where:
                raise ValueError(f"sample {s} appears twice in dst_batches")
            where[s] = (r, slot)
    flat = [s for batch in src_batches for s in batch]
    if len(flat) != len(set(flat)):
        raise ValueError("a sample appears twice in src_batches")
    samples, src, dst = [], [], []
    for r, batch in enumerate(src_batches):
        for slot, s in enumerate(batch):
            if s not in where:
                raise ValueError(f"sample {s} of src_batches is missing from dst_batches")
            samples.append(s)
            src.append((r, slot))
            dst.append(where.pop(s))
    if where:
        raise ValueError(f"samples {sorted(where)[:8]} of dst_batches are missing from src_batches")
    return Rearrangement(tuple(samples), tuple(src), tuple(dst), len(src_batches), len(dst_batches))


def compose_rearrangement(encoder_batches: Mapping[str, Sequence[Sequence[int]]],
                          llm_batches: Sequence[Sequence[int]]) -> dict[str, Rearrangement]:
    """Per encoder E, Pi_M o Pi_E^-1 (OrchMLLM §6): encoder outputs straight to their LLM rank.

    ``encoder_batches[E][r]``: sample ids encoder E runs on rank r (its balanced, node-wise
    placed batches; only samples that have E's modality). ``llm_batches[r]``: sample ids the
    LLM runs on rank r. Sample s's output moves from (encoder rank, slot) to (LLM rank, slot),
    the LLM slot counting only that rank's samples which have E's modality, in LLM order.
    Going through the original instances (Pi_E^-1, then Pi_M) lands every output in the same
    place, with one all-to-all instead of two.
    """
    out = {}
    for name, batches in encoder_batches.items():
        members = {s for b in batches for s in b}
        dst = [[s for s in b if s in members] for b in llm_batches]
        try:
            out[name] = rearrangement(batches, dst)
        except ValueError as e:
            raise ValueError(f"encoder {name!r}: {e}") from None
    return out
