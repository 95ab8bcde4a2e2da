"""Closed-form solver of the orchestrator's convex relaxation (DistTrain §5.2), batched over
candidates, in numpy (no JAX, no cvxpy).

The problem of record is `relaxed_problem.RelaxedProblem` (cvxpy, DPP): over continuous GPU
counts x_u, one per unit,

    min M tau + s + sum_u [slope_u x_u + max(w_u, wc_u / x_u)]
    s.t. c_u / x_u <= tau,  e_u / x_u <= s,  lo_u <= x_u <= hi_u,  sum_u x_u <= N.

With at most one unit carrying a sync volume e_u (the LLM), s = e_u / x_u folds into that
unit's term, and the problem is solved exactly through its Lagrangian dual in the budget
multiplier lambda >= 0:

- For a fixed lambda, each unit's term h_u(x) + lambda x is convex with the unconstrained
  minimiser g_u(lambda) (sqrt(A / (slope_u + lambda)) on either side of the warm-up kink
  x = wc_u / w_u, or the kink itself), so x_u(tau) = min(hi_u, max(g_u, lo_u, c_u / tau)).
- The objective in tau is then convex with derivative
  M - sum_{u bound by c_u / tau} (c_u (slope_u + lambda) / tau^2 - A_u / c_u), piecewise of
  the form a - b / tau^2 between at most 2k + 1 breakpoints: tau*(lambda) is found in closed
  form on the interval where the derivative changes sign.
- sum_u x_u(lambda) is non-increasing in lambda (the dual is concave): lambda = 0 when the
  budget is slack, otherwise bisection (in log lambda, to machine precision) on
  sum_u x_u = N, keeping the feasible side.

Every candidate of a batch is solved at once (arrays [candidates, units]); the answer
matches cvxpy/Clarabel to its tolerance (tests/test_planner_fast.py).
"""
from __future__ import annotations

import numpy as np

_LOG_GRID = np.linspace(-60.0, 60.0, 9)  # first bracket of log(lambda): [1e-26, 1e26]
_LOG_TOL = 1e-13  # log(lambda) to this: x to ~1e-13 relative (x ~ lambda^-1/2)
_MAX_STEPS = 80


class _Rows:
    """The per-row constants of a batch of relaxations (arrays [B, k] and [B])."""

    def __init__(self, c, e, slope, lo, hi, w, wc, tau_floor, mm):
        self.c, self.e, self.slope, self.lo, self.hi = c, e, slope, lo, hi
        self.w, self.wc, self.mm, self.tau_floor = w, wc, mm, tau_floor
        self.kink = np.where(w > 0, wc / w, np.inf)  # beyond it the warm-up is constant w
        self.tau_k = np.where(wc > 0, c * w / wc, 0.0)  # tau >= tau_k: left of the kink
        self.ewc = e + wc

    def take(self, rows) -> "_Rows":
        return _Rows(*(getattr(self, k)[rows] for k in
                       ("c", "e", "slope", "lo", "hi", "w", "wc", "tau_floor", "mm")))

    def repeat(self, times: int) -> "_Rows":
        return _Rows(*(np.repeat(getattr(self, k), times, axis=0) for k in
                       ("c", "e", "slope", "lo", "hi", "w", "wc", "tau_floor", "mm")))


def _allocation(lam, r: _Rows):
    """(x, tau) minimising the Lagrangian at budget multiplier lambda (one per row)."""
    b = np.maximum(r.slope + lam[:, None], 1e-300)
    # g_u: minimiser of (slope + lambda) x + max(w, wc / x) + e / x, left or right of the kink
    left, right = np.sqrt(r.ewc / b), np.sqrt(r.e / b)
    g = np.where(left < r.kink, left, np.maximum(right, r.kink))
    floor = np.maximum(g, r.lo)
    tau_c = r.c / np.minimum(floor, r.hi)  # unit u is bound by c_u / tau for tau < tau_c
    # tau*: the smallest tau >= tau_floor where the derivative of the convex objective in tau,
    # mm - sum_{bound u} (c_u b_u / tau^2 - A_u / c_u), is >= 0: on each interval between
    # breakpoints it is a - k / tau^2, so the root is sqrt(k / a)
    tf = r.tau_floor[:, None]
    pts = np.sort(np.maximum(np.concatenate([tf, tau_c, r.tau_k], axis=1), tf), axis=1)
    p = pts[:, :, None]
    active = p < tau_c[:, None, :]
    a_u = r.e[:, None, :] + r.wc[:, None, :] * (p >= r.tau_k[:, None, :])
    k_sum = np.sum(active * (r.c * b)[:, None, :], axis=2)
    d_sum = r.mm[:, None] + np.sum(np.where(active, a_u / r.c[:, None, :], 0.0), axis=2)
    deriv = d_sum - k_sum / pts ** 2
    root = np.where(d_sum > 0, np.sqrt(k_sum / d_sum), np.inf)
    nxt = np.concatenate([pts[:, 1:], np.full((len(pts), 1), np.inf)], axis=1)
    cand = np.where(deriv >= 0, pts, np.where(root < nxt, np.maximum(root, pts), np.inf))
    tau = np.min(cand, axis=1)
    tau = np.where(np.isfinite(tau), tau, pts[:, -1])
    x = np.minimum(r.hi, np.maximum(floor, r.c / tau[:, None]))
    return x, tau


def _log_lambda(r: _Rows, n):
    """log(lambda) with sum_u x_u(lambda) = n per row, on the feasible side (sum <= n):
    a grid brackets the root, then Illinois regula falsi (bracketing, superlinear) on the
    non-increasing phi(t) = sum x(e^t) - n."""
    rows, grid = len(n), _LOG_GRID
    phi = (_allocation(np.exp(np.tile(grid, rows)), r.repeat(len(grid)))[0].sum(axis=1)
           .reshape(rows, len(grid)) - n[:, None])
    j = np.clip(np.argmax(phi <= 0, axis=1), 1, len(grid) - 1)  # first feasible grid point
    a, b = grid[j - 1], grid[j]
    fa, fb = phi[np.arange(rows), j - 1], phi[np.arange(rows), j]
    side = np.zeros(rows)
    for _ in range(_MAX_STEPS):
        live = (b - a > _LOG_TOL) & (fb < 0) & (fa > 0)
        if not live.any():
            break
        t = np.where(fa != fb, (a * fb - b * fa) / (fb - fa), 0.5 * (a + b))
        t = np.where((t > a) & (t < b), t, 0.5 * (a + b))
        ft = _allocation(np.exp(t), r)[0].sum(axis=1) - n
        right = live & (ft <= 0)  # t is feasible: the new right end
        left = live & (ft > 0)
        fa = np.where(right & (side == 1), 0.5 * fa, fa)  # Illinois: halve the stale end
        fb = np.where(left & (side == -1), 0.5 * fb, fb)
        b, fb = np.where(right, t, b), np.where(right, ft, fb)
        a, fa = np.where(left, t, a), np.where(left, ft, fa)
        side = np.where(right, 1, np.where(left, -1, side))
    return b


def solve_relaxed(c, e, slope, lo, hi, n, mm, w, wc):
    """Optimum value, x and feasibility of the relaxation for every row (arrays [B, k]; n,
    mm of shape [B] or scalars). Rows with sum(lo) > n or lo > hi are infeasible (value
    inf)."""
    c, e, slope, lo, hi, w, wc = (np.atleast_2d(np.asarray(a, dtype=np.float64))
                                  for a in (c, e, slope, lo, hi, w, wc))
    n = np.broadcast_to(np.asarray(n, dtype=np.float64), (len(c),))
    mm = np.broadcast_to(np.asarray(mm, dtype=np.float64), (len(c),))
    if np.any(np.count_nonzero(e, axis=1) > 1):
        raise ValueError("solve_relaxed: at most one unit per row may have a sync volume e_u "
                         "(the LLM); use orchestrate's method='cvxpy' otherwise")
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        ok = (lo.sum(axis=1) <= n) & np.all(lo <= hi, axis=1) & np.all(c >= 0, axis=1)
        rows = _Rows(c, e, slope, lo, hi, w, wc, np.max(c / hi, axis=1), mm)
        x, tau = _allocation(np.zeros(len(c)), rows)
        tight = np.flatnonzero((x.sum(axis=1) > n) & ok)  # the budget binds: lambda > 0
        if len(tight):
            sub = rows.take(tight)
            x[tight], tau[tight] = _allocation(np.exp(_log_lambda(sub, n[tight])), sub)
        s = np.max(e / x, axis=1)
        tau = np.maximum(tau, np.max(c / x, axis=1))
        value = (mm * tau + s + np.sum(slope * x, axis=1)
                 + np.sum(np.maximum(w, wc / x), axis=1))
    return np.where(ok, value, np.inf), x, ok
