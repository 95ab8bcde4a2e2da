"""OrchMLLM §5.2.2, Algorithm 3 as a mixed-integer program, solved with HiGHS (highspy; no
JAX): which node each new mini-batch goes to so the largest per-rank inter-node all-to-all
volume (Eq. 5) is least. `balance.node_wise_rearrange` calls it up to a rank count, warm-started
from the greedy placement improved by pairwise swaps (`balance.node_swaps`), and keeps the best
of it, those and the identity.

HiGHS proves small instances optimal (checked against brute force in
tests/test_node_wise_optimality.py); from a few tens of ranks its LP relaxation is weak
(every source rank spreads its samples over nearly every new batch, so fractional
placements split each volume evenly) and a time-limited run keeps a gap to its bound
(scripts/bench_balance.py part 2 measures it)."""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import numpy as np


@contextmanager
def _quiet_stdout():
    """Process stdout (file descriptor 1) to /dev/null for the block: HiGHS' C++ constructor
    prints its version banner there before any option (`output_flag`) can be set."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _milp_model(v: np.ndarray, c: int, include_recv: bool):
    """Algorithm 3 as a HiGHS MILP (rows of a sparse matrix): x[b, n] = 1 when new batch b
    lives on node n (column b * nn + n), t (the last column) bounds every rank's inter-node
    send (sum_b v[r, b] (1 - x[b, node(r)]) <= t) and, with ``include_recv``, every new
    batch's inter-node receive; each batch on one node, c batches per node."""
    import highspy

    d = v.shape[0]
    nn = d // c
    nodecost = v.reshape(nn, c, d).sum(axis=1)  # [node, batch]: volume already there
    t = d * nn
    starts, cols, vals, lo, hi = [0], [], [], [], []

    def row(cs, vs, lower, upper):
        cols.extend(cs)
        vals.extend(vs)
        starts.append(len(cols))
        lo.append(lower)
        hi.append(upper)

    inf = highspy.kHighsInf
    for b in range(d):
        row(range(b * nn, (b + 1) * nn), [1.0] * nn, 1.0, 1.0)
    for n in range(nn):
        row(range(n, t, nn), [1.0] * d, float(c), float(c))
    for r in range(d):
        bs = np.flatnonzero(v[r])
        row((bs * nn + r // c).tolist() + [t], (-v[r, bs]).tolist() + [-1.0], -inf,
            -float(v[r].sum()))
    if include_recv:
        total = v.sum(axis=0)
        for b in range(d):
            ns = np.flatnonzero(nodecost[:, b])
            row((b * nn + ns).tolist() + [t], (-nodecost[ns, b]).tolist() + [-1.0], -inf,
                -float(total[b]))
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = t + 1, len(lo)
    lp.col_cost_ = np.r_[np.zeros(t), 1.0]
    lp.col_lower_ = np.zeros(t + 1)
    lp.col_upper_ = np.r_[np.ones(t), inf]
    lp.row_lower_, lp.row_upper_ = np.array(lo), np.array(hi)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(cols, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(vals, dtype=np.float64)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * t + [highspy.HighsVarType.kContinuous]
    return lp


def milp_nodes(v: np.ndarray, c: int, include_recv: bool, time_limit: float,
                info: dict, start: np.ndarray | None = None,
                start_objective: float | None = None) -> np.ndarray | None:
    """Algorithm 3 as a MILP with HiGHS (highspy), warm-started from ``start`` (a node per
    batch, e.g. the greedy placement, with its objective) so a time-limited solve keeps at
    least that. Sets info["milp_status"] ("optimal", or "user_limit" when the time limit
    stopped it), info["milp_bound"] (HiGHS' proven lower bound on the objective) and
    info["milp_gap"] (relative gap of the returned answer to that bound; 0 when optimal)."""
    import highspy

    d = v.shape[0]
    nn = d // c
    with _quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit))
    if h.passModel(_milp_model(v, c, include_recv)) != highspy.HighsStatus.kOk:
        info["milp_status"] = "solver_error"
        return None
    if start is not None:
        sol = np.zeros(d * nn + 1)
        sol[np.arange(d) * nn + start] = 1.0
        assert start_objective is not None  # the caller passes start with its objective
        sol[-1] = float(start_objective)
        warm = highspy.HighsSolution()
        warm.col_value = sol.tolist()
        warm.value_valid = True
        h.setSolution(warm)
    h.run()
    status = h.getModelStatus()
    info["milp_status"] = ("optimal" if status == highspy.HighsModelStatus.kOptimal
                           else "user_limit" if status == highspy.HighsModelStatus.kTimeLimit
                           else h.modelStatusToString(status))
    hinfo = h.getInfo()
    info["milp_bound"] = float(hinfo.mip_dual_bound)
    info["milp_gap"] = 0.0 if info["milp_status"] == "optimal" else float(hinfo.mip_gap)
    if hinfo.primal_solution_status != highspy.SolutionStatus.kSolutionStatusFeasible:
        return None
    xv = np.rint(np.asarray(h.getSolution().col_value)[:-1]).astype(np.int64).reshape(d, nn)
    if not (np.all(xv.sum(axis=1) == 1) and np.all(xv.sum(axis=0) == c)):
        return None
    return xv.argmax(axis=1)
