"""DistTrain disaggregated data reordering (DistTrain §6) and the pipeline recurrence behind it.

* ``intra_reorder``: Algorithm 2 (§6.1), greedy number partitioning of a global batch over DP
  groups so no group is an intra-microbatch straggler (§2.3, Figure 6).
* ``inter_reorder``: Algorithm 3 (§6.2), order the microbatches of one DP group so the pipeline
  intervals at the first PP stage are filled (Figure 12), with GETINTERVAL computed by the
  pipeline recurrence below; the VPP (interleaved 1F1B) variant is the last paragraph of §6.2;
  by default guarded to never lose to the ascending or the given order.
* ``pipeline_time``: the iteration time of an order under the §6.2 recurrence, which is
  schedule/simulate.py's timing model (``PipelineModel``: 1F1B and interleaved 1F1B from
  schedule/schedule.py's tables), also what GETINTERVAL reads.
* ``exhaustive_best_order``: the optimum over all orders, for scoring on small ``l``.

Cost model (what ``costs`` holds). §6.2 measures a microbatch by "the computation time of the
microbatch in the modality encoder and generator" and fills intervals "in sum forward time".
We model one pipelined unit whose layers are split evenly over its ``p`` stages, so microbatch
``j`` takes the same forward time ``f_j`` and backward time ``b_j`` on every stage (and
``f_j / v``, ``b_j / v`` per model chunk with ``v`` = ``num_chunks``). Each entry of ``costs`` is
either a scalar ``f_j`` (then ``b_j = backward_ratio * f_j``, default 2: backward ~ 2x forward;
use 0 for a frozen encoder) or a pair ``(f_j, b_j)``. Only relative values matter.
``stage_costs`` (optional, one (scale, forward offset, backward offset) per stage) gives the
paper's heterogeneous pipeline instead: stage s runs microbatch j's forward in
``scale_s * f_j + fwd_offset_s`` (backward likewise), e.g. an encoder stage (1, 0, 0), LLM
stages (0, F, B) whose time is fixed by the fixed sequence length (§2.3), and a generator
stage (gamma, 0, 0); Algorithm 3 then fills stage-0 intervals with ``scale_0 * f_j``.
No JAX here: this runs on the host while the data is prepared (§6: "integrated into data
preprocessing").
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

from mmjax.data.balance import greedy_partition
from mmjax.schedule.simulate import (PipelineModel, batch_iteration_time, check_stages,
                                     stage_affine)

# Above this many candidate subsets SELECTCLOSEST for the first interval switches from exact
# enumeration to a greedy pick (keeps inter_reorder O(l * (l + p)) per call, as in §6.2).
_MAX_EXACT_SUBSETS = 20_000


def intra_reorder(sizes: Sequence[float], num_groups: int) -> list[list[int]]:
    """Algorithm 2 (DistTrain §6.1): split a global batch over ``num_groups`` DP groups.

    Greedy number partitioning: samples by size, each to the currently lightest group. Returns
    sample indices per DP group. Deviation: the paper's line 3 sorts *ascending*, but the
    4/3 guarantee it cites ([37], Graham's LPT) holds for *descending* order; ascending is only
    a (2 - 1/m)-approximation (sizes [1, 1, 2], m = 2 gives 3 vs 2). We sort descending, which
    makes this the same algorithm as OrchMLLM's Algorithm 1 (``post_balance(..., "sum")``).
    """
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int (the DP size), got {num_groups!r}")
    return greedy_partition(sizes, num_groups, name="sizes")


def _fwd_bwd(costs: Sequence, backward_ratio: float) -> tuple[list[float], list[float]]:
    """Normalise ``costs`` (scalars or (forward, backward) pairs) to two float lists."""
    if backward_ratio < 0 or not math.isfinite(backward_ratio):
        raise ValueError(f"backward_ratio must be finite and >= 0, got {backward_ratio}")
    fwd, bwd = [], []
    for j, c in enumerate(costs):
        if isinstance(c, (tuple, list)):
            if len(c) != 2:
                raise ValueError(f"costs[{j}] must be a scalar forward time or a (forward, "
                                 f"backward) pair, got {c!r}")
            f, b = float(c[0]), float(c[1])
        else:
            f = float(c)
            b = backward_ratio * f
        if not (math.isfinite(f) and math.isfinite(b)) or f < 0 or b < 0:
            raise ValueError(f"costs[{j}] must be finite and >= 0, got {c!r}")
        fwd.append(f)
        bwd.append(b)
    return fwd, bwd


# Local search: the full neighbourhood up to this many microbatches; beyond, swaps and moves
# within a window of positions and fewer rounds from one start (bounded time at l = 64).
_FULL_SEARCH_MAX_L = 16
_WINDOW = 8


def _neighbour_moves(l: int, window: int) -> np.ndarray:
    """Index rows [moves, l]: every swap of two positions and every move of one microbatch
    to another position, at most ``window`` apart (the neighbourhood of `improve_order`)."""
    base = np.arange(l)
    rows = []
    for i in range(l):
        for j in range(i + 1, min(l, i + window + 1)):
            r = base.copy()
            r[i], r[j] = j, i
            rows.append(r)
    for i in range(l):
        for j in range(max(0, i - window), min(l, i + window + 1)):
            if abs(i - j) > 1:  # adjacent moves are swaps
                rows.append(np.insert(np.delete(base, i), j, i))
    return np.array(rows, dtype=np.int64).reshape(-1, l)


def improve_order(order: Sequence[int], fwd: Sequence[float], bwd: Sequence[float],
                  model: PipelineModel, rounds: int) -> list[int]:
    """Best-improvement local search on the §6.2 recurrence: each round scores every swap
    and every single move of the current order at once (`batch_iteration_time`) and takes
    the best if it is faster; stops at a local optimum or after ``rounds`` rounds. Never
    returns a slower order than it was given."""
    cur = np.asarray(order, dtype=np.int64)
    if cur.size < 2 or rounds <= 0:
        return cur.tolist()
    f, b = np.asarray(fwd, dtype=np.float64), np.asarray(bwd, dtype=np.float64)
    moves = _neighbour_moves(cur.size, cur.size if cur.size <= _FULL_SEARCH_MAX_L
                             else _WINDOW)
    t_cur = float(batch_iteration_time(model, f[cur][None], b[cur][None])[0])
    for _ in range(rounds):
        cand = cur[moves]
        times = batch_iteration_time(model, f[cand], b[cand])
        k = int(np.argmin(times))
        if times[k] >= t_cur - 1e-12 * max(1.0, abs(t_cur)):
            break
        cur, t_cur = cand[k], float(times[k])
    return cur.tolist()


def pipeline_time(costs: Sequence, num_stages: int, order: Sequence[int] | None = None,
                  num_chunks: int = 1, backward_ratio: float = 2.0,
                  stage_costs: Sequence[tuple[float, float, float]] | None = None) -> float:
    """Iteration time of 1F1B (or interleaved 1F1B) when microbatches run in ``order``.

    ``order[k]`` is the microbatch run k-th (default: as given). See the module docstring for
    the meaning of ``costs``.
    """
    fwd, bwd = _fwd_bwd(costs, backward_ratio)
    order = list(range(len(fwd))) if order is None else list(order)
    if sorted(order) != list(range(len(fwd))):
        raise ValueError(f"order must be a permutation of range({len(fwd)}), got {order}")
    model = PipelineModel.build(num_stages, len(fwd), num_chunks, stage_costs)
    return model.iteration_time([fwd[j] for j in order], [bwd[j] for j in order])


def exhaustive_best_order(costs: Sequence, num_stages: int, num_chunks: int = 1,
                          backward_ratio: float = 2.0,
                          stage_costs: Sequence[tuple[float, float, float]] | None = None,
                          ) -> tuple[list[int], float]:
    """Optimal order by trying all l! orders (first one found on ties). For l <= 8 only."""
    fwd, bwd = _fwd_bwd(costs, backward_ratio)
    if len(fwd) > 8:
        raise ValueError(f"exhaustive search is for l <= 8 microbatches, got {len(fwd)}")
    model = PipelineModel.build(num_stages, len(fwd), num_chunks, stage_costs)
    best, best_t = list(range(len(fwd))), math.inf
    for perm in itertools.permutations(range(len(fwd))):
        t = model.iteration_time([fwd[j] for j in perm], [bwd[j] for j in perm])
        if t < best_t - 1e-12:
            best, best_t = list(perm), t
    return best, best_t


def _select_closest(cands: list[int], fwd: list[float], count: int, target: float) -> list[int]:
    """SELECTCLOSEST: ``count`` candidates whose summed forward time is closest to ``target``.

    Exact over all subsets when there are at most _MAX_EXACT_SUBSETS of them; otherwise greedy
    (repeatedly the candidate closest to the remaining target per remaining pick). Candidates
    are pre-sorted by (forward time, index), so ties resolve deterministically.
    """
    count = min(count, len(cands))
    if count == 0:
        return []
    if math.comb(len(cands), count) <= _MAX_EXACT_SUBSETS:
        best = min(itertools.combinations(cands, count),
                   key=lambda sub: abs(sum(fwd[j] for j in sub) - target))
        return list(best)
    pool, chosen, left = list(cands), [], target
    for r in range(count, 0, -1):
        j = min(pool, key=lambda i: abs(fwd[i] - left / r))
        pool.remove(j)
        chosen.append(j)
        left -= fwd[j]
    return sorted(chosen, key=lambda i: (fwd[i], i))


def inter_reorder(costs: Sequence, num_stages: int, num_chunks: int = 1,
                  backward_ratio: float = 2.0, guard: bool = True,
                  stage_costs: Sequence[tuple[float, float, float]] | None = None,
                  improve_rounds: int = 16) -> list[int]:
    """Algorithm 3 (DistTrain §6.2): the order to run one DP group's microbatches in;
    ``order[k]`` = index of the microbatch run k-th.

    The smallest microbatch first, the p-1 smallest of the rest last (1F1B only), then each
    position gets the microbatch whose forward time best fills its GETINTERVAL gap on stage
    0. ``guard`` (our addition) also scores the given and the ascending order and takes the
    fastest; ``improve_rounds`` of local search (`improve_order`) polish each first. The
    deviations from the pseudo-code and the measurements behind them: docs/design.md
    "Inter-microbatch reordering".
    """
    fwd, bwd = _fwd_bwd(costs, backward_ratio)
    l, p, v = len(fwd), num_stages, num_chunks
    check_stages(p, v, l)
    if l == 0:
        return []
    model = PipelineModel.build(p, l, v, stage_costs)
    order = _algorithm3(fwd, bwd, p, v, model, stage_affine(stage_costs, p)[0][0])
    if not guard:
        return order
    return _guarded(order, fwd, bwd, model, improve_rounds)


def _algorithm3(fwd, bwd, p: int, v: int, model, scale0: float) -> list[int]:
    """Algorithm 3's order: first, rear block, then closest fit of each interval."""
    l = len(fwd)
    by_size = sorted(range(l), key=lambda j: (fwd[j], j))
    first, rest = by_size[0], by_size[1:]
    n_rear = min(p - 1 if v == 1 else 0, len(rest))
    rear = sorted(rest[:n_rear], key=lambda j: (-fwd[j], j))
    pending = rest[n_rear:]  # still sorted by (forward, index)
    slots: list[int | None] = [first, *([None] * len(pending)), *rear]
    fill = [scale0 * x for x in fwd]  # what a microbatch adds to stage 0's forward passes
    stage0 = [a for a, act in enumerate(model.actions) if act[1] == 0]
    while pending:
        k = slots.index(None)
        group = [i for i in range(1, p) if slots[i] is None] if k < p else [k]
        f_pos = [0.0 if j is None else fwd[j] for j in slots]
        b_pos = [0.0 if j is None else bwd[j] for j in slots]
        start, end = model.times(f_pos, b_pos)
        interval = 0.0
        for n, a in enumerate(stage0[:-1]):
            kind, _s, pos, _c = model.actions[a]
            if kind == "F" and pos in group:
                interval += start[stage0[n + 1]] - end[a]
        chosen = _select_closest(pending, fill, len(group), interval)
        for pos, j in zip(group, chosen):
            slots[pos] = j
            pending.remove(j)
    return [j for j in slots if j is not None]


def _guarded(order: list[int], fwd, bwd, model, improve_rounds: int) -> list[int]:
    """The fastest of Algorithm 3's, the ascending and the given order, each improved by
    local search first (long runs: the best one only, fewer rounds)."""
    l = len(fwd)
    candidates = [order, sorted(range(l), key=lambda j: (fwd[j], j)), list(range(l))]
    times = [model.iteration_time([fwd[j] for j in c], [bwd[j] for j in c]) for c in candidates]
    if improve_rounds > 0 and l > _FULL_SEARCH_MAX_L:  # long runs: one start, fewer rounds
        best = candidates[times.index(min(times))]
        return improve_order(best, fwd, bwd, model, max(2, improve_rounds * 16 // l))
    if improve_rounds > 0:  # local search from each, the first of the fastest wins
        candidates = [improve_order(c, fwd, bwd, model, improve_rounds) for c in candidates]
        times = [model.iteration_time([fwd[j] for j in c], [bwd[j] for j in c])
                 for c in candidates]
    return candidates[times.index(min(times))]
