"""The convex relaxation of DistTrain §5.2 (Eq. 1-2) as a DPP-parameterised cvxpy problem:
the planner's formulation of record (docs/design.md "The planner"); build once per number of
units, re-solve with new parameter values per candidate."""
from __future__ import annotations

import math
import warnings

import numpy as np


class RelaxedProblem:
    """The DPP-parameterised convex relaxation for k units; build once, re-solve often."""

    def __init__(self, k: int):
        import cvxpy as cp  # the formulation of record; cvxpy imports jax: load it on use

        self.k = k
        self.x = cp.Variable(k)
        self.tau = cp.Variable(nonneg=True)
        self.s = cp.Variable(nonneg=True)
        self.c = cp.Parameter(k, nonneg=True)
        self.e = cp.Parameter(k, nonneg=True)
        self.slope = cp.Parameter(k, nonneg=True)
        self.lo = cp.Parameter(k, nonneg=True)
        self.hi = cp.Parameter(k, nonneg=True)
        self.n = cp.Parameter(nonneg=True)
        self.mm = cp.Parameter(nonneg=True)
        self.w = cp.Parameter(k, nonneg=True)  # warm-up floor C_u (0 for the LLM)
        self.wc = cp.Parameter(k, nonneg=True)  # c_u for units whose DP is free, else 0
        inv = cp.inv_pos(self.x)
        cons = [cp.multiply(self.c, inv) <= self.tau, cp.multiply(self.e, inv) <= self.s,
                self.x >= self.lo, self.x <= self.hi, cp.sum(self.x) <= self.n]
        # warm-up of a unit with DP_u <= DP_llm: (DP_llm / DP_u) C_u >= max(C_u, c_u / x_u)
        warm = cp.sum(cp.maximum(self.w, cp.multiply(self.wc, inv)))
        obj = cp.Minimize(self.mm * self.tau + self.slope @ self.x + self.s + warm)
        self.problem = cp.Problem(obj, cons)
        assert self.problem.is_dpp()

    def solve(self, c, e, slope, lo, hi, n, mm, w=None, wc=None
              ) -> tuple[float, np.ndarray] | None:
        """Optimum and x of the relaxation; `w`, `wc` (default 0) add the warm-up floor."""
        import cvxpy as cp

        if np.sum(lo) > n or np.any(lo > hi):
            return None
        zero = np.zeros(self.k)
        self.w.value = zero if w is None else w
        self.wc.value = zero if wc is None else wc
        self.c.value, self.e.value, self.slope.value = c, e, slope
        self.lo.value, self.hi.value = lo, hi
        self.n.value, self.mm.value = float(n), float(mm)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.problem.solve(solver=cp.CLARABEL)
        except cp.error.SolverError:
            return None
        if self.problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE):
            return None
        # an inaccurate optimum is not a safe bound: report -inf so nothing is pruned on it
        value = float(self.problem.value) if self.problem.status == cp.OPTIMAL else -math.inf
        return value, np.asarray(self.x.value, dtype=np.float64)
