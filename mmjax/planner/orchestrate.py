"""Disaggregated model orchestration: DistTrain §5.2, Algorithm 1 (no JAX).

Enumerate the parallelism part (TP per unit, the LLM's DP), bound and solve the convex
relaxation over continuous GPU counts per candidate, skip candidates whose bound cannot win,
repair the relaxed optimum to integers and price the neighbours exactly; among plans within
`GPU_TOLERANCE` of the least time take the one with the fewest GPUs. The formulation, the
bounds, the repair and the tie-break: docs/design.md "The planner".
"""
from __future__ import annotations

import itertools
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from mmjax.planner.candidates import candidate_table, divisors, share_bound
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, choice_error, evaluate, leanest, p2p_time,
                                    remat_variant, state_need, sync_share, sync_time,
                                    warmup_time)
from mmjax.planner.hardware import Hardware
from mmjax.planner.plan import PlanError
from mmjax.planner.infeasible import infeasible_message, smallest_plan
from mmjax.planner.relax import solve_relaxed
from mmjax.planner.relaxed_problem import RelaxedProblem
from mmjax.planner.frontier import Frontier
from mmjax.planner.repair import OptionTable, combine
from mmjax.models.units import has_llm


# Relative slack on the predicted iteration time within which the plan using fewer GPUs
# wins (`Orchestrator.solve`); about the accuracy of the cost model itself.
GPU_TOLERANCE = 0.01


METHODS = ("fast", "cvxpy")


@dataclass(frozen=True)
class OrchestrationResult:
    choices: dict[str, Choice]
    iteration_time_s: float
    solve_time_s: float
    candidates: int  # (TP, DP) candidates enumerated
    relaxations: int  # convex problems solved
    repairs: int  # candidates whose integer neighbourhood was searched
    optimal_time_s: float = math.nan  # T*: least predicted time (before the GPU tie-break)
    frontier: "Frontier | None" = None  # every repaired plan on a (GPUs, time) Pareto front
    # (candidates, priced option tables) of this solve, for a re-solve that changes only
    # some units' in-flight scale (build.py `_fit`): `SearchState`
    state: "SearchState | None" = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class SearchState:
    """What a solve computed that a re-solve may keep: the (TP, DP) candidates with their
    bounds (they depend on the LLM's memory alone: the other units enter them through
    their least activations, not their in-flight scale) and the option tables per
    (unit index, TP, LLM DP) (each depends on its own unit's cost alone); with the
    candidates, the relaxations solved so far in their order (functions of the candidates'
    inputs and the units' times, which an in-flight scale leaves alone)."""

    candidates: list | None  # None: to recompute (`keep` after the LLM changed)
    tables: dict
    relaxed: list = field(default_factory=list)

    def keep(self, changed: set[int], llm: int) -> "SearchState":
        """The parts still valid when the units at indices `changed` change their in-flight
        scale (build.py `_deeper`)."""
        same = llm not in changed
        return SearchState(self.candidates if same else None,
                           {k: v for k, v in self.tables.items() if k[0] not in changed},
                           self.relaxed if same else [])


class Orchestrator:
    """Algorithm 1 of DistTrain over `UnitCost`s (any number of encoder units)."""

    def __init__(self, costs: tuple[UnitCost, ...], hw: Hardware, vpp: bool = True,
                 relaxed_factory=None, method: str = "fast"):
        names = [c.name for c in costs]
        if not has_llm(names):
            raise ValueError(f"orchestrate: no 'llm' unit among {names}")
        if method not in METHODS:
            raise ValueError(f"orchestrate: method={method!r}; choose one of {METHODS}")
        self.costs = tuple(costs)
        self.hw = hw
        self.vpp = vpp
        self.llm = names.index("llm")
        # "fast": candidates bounded with numpy (candidates.py), relaxations solved in closed
        # form in batches (relax.py); "cvxpy": the scalar bounds and the DPP problem of
        # record, built once per orchestrator and re-solved per candidate;
        # `relaxed_factory(k)` substitutes it (tests count constructions) and implies cvxpy
        self.method = "cvxpy" if relaxed_factory is not None else method
        self.relaxed = ((relaxed_factory or RelaxedProblem)(len(costs))
                        if self.method == "cvxpy" else None)
        self._priced: dict[tuple, OptionTable] = {}  # (unit, TP, LLM DP) -> OptionTable, within one solve
        self._solved: list = []  # fast method: (value, x) per candidate, in order

    # ---- candidate bounds --------------------------------------------------------------
    def _warm_terms(self, tps, c):
        w = np.array([0.0 if i == self.llm else cost.time_s[t]
                      for i, (cost, t) in enumerate(zip(self.costs, tps))])
        wc = np.where(np.arange(len(c)) == self.llm, 0.0, c)
        return w, wc

    @staticmethod
    def _share_bound(c, lo, hi, n) -> float:
        """Closed-form relaxation for a set of units sharing n GPUs: the smallest tau with
        sum_u max(lo_u, c_u / tau) <= n (and c_u / tau <= hi_u); candidates.share_bound."""
        return float(share_bound(c, lo, hi, np.float64(n)))

    def _bound(self, tps, dp_llm, inputs, n, bs) -> float:
        """Lower bound of the candidate: the LLM's PP enumerated exactly (few divisors of
        its layers), the other units relaxed to a continuous share of the rest."""
        c, _, _, lo, hi, mm = inputs
        cost, t, hw = self.costs[self.llm], tps[self.llm], self.hw
        rest = np.arange(len(c)) != self.llm
        pps = divisors(cost.num_layers) if cost.layer_pp_divides else range(1, cost.num_layers + 1)
        m, best = bs // dp_llm, math.inf
        for pp in pps:
            ch = Choice(t, dp_llm, pp)
            if ch.gpus + lo[rest].sum() > n:
                break
            fits = [Choice(t, dp_llm, pp, v) for v in ((2, 1) if self.vpp else (1,))
                    if choice_error(cost, Choice(t, dp_llm, pp, v), dp_llm, m, hw) is None]
            if not fits:
                continue
            share = self._share_bound(c[rest], lo[rest], hi[rest], n - ch.gpus)
            for f in fits:  # each at the remat variant it runs (the least recompute that fits)
                rc = remat_variant(cost, f, dp_llm, m, hw.hbm_bytes)
                tau = max(rc.time_s[t] / pp, share)
                val = mm * tau + warmup_time(rc, f, dp_llm, hw) + sync_time(cost, ch, hw)
                best = min(best, val)
        others = sum(cost.time_s[t] for i, (cost, t) in enumerate(zip(self.costs, tps))
                     if i != self.llm)
        return others + best

    def _relaxed_inputs(self, tps, dp_llm, n, bs):
        hw, m = self.hw, bs // dp_llm
        k = len(self.costs)
        c, e, slope, lo, hi = (np.zeros(k) for _ in range(5))
        for i, (cost, t) in enumerate(zip(self.costs, tps)):
            c[i] = dp_llm * t * cost.time_s[t]
            dp_lo = dp_llm if i == self.llm else 1
            slope[i] = p2p_time(cost, Choice(t, dp_llm, 1), dp_llm, hw) / (t * dp_llm)
            if i == self.llm and dp_llm > 1 and cost.grad_bytes:
                e[i] = (2 * (dp_llm - 1) * cost.grad_bytes / hw.group_bw(dp_llm * t)
                        * sync_share(cost))
            # memory: (weights * dp + optimizer) / x + activations <= HBM (activations at
            # their smallest: one sample per rank, in-flight/pp >= min(1, m / layers))
            act = leanest(cost).activation_bytes[t] * min(1.0, m / cost.num_layers)
            room = hw.hbm_bytes - act
            if room <= 0:
                return None
            need = state_need(cost, dp_lo) / room
            lo[i] = max(float(t * dp_lo), need)
            hi[i] = float(t * dp_llm * cost.num_layers)
        return c, e, slope, lo, hi, m - 1

    # ---- integer repair ----------------------------------------------------------------
    def _table(self, i, t, dp_llm, n, m) -> OptionTable:
        """Unit i's priced integer choices at (TP, LLM DP), built once per solve."""
        key = (i, t, dp_llm)
        if key not in self._priced:
            self._priced[key] = OptionTable(self.costs[i], self.hw, t, dp_llm, m, n,
                                            i == self.llm, self.vpp)
        return self._priced[key]

    def _repair(self, tps, dp_llm, x, tau, s, n, bs):
        m = bs // dp_llm
        tables = [self._table(i, t, dp_llm, n, m) for i, t in enumerate(tps)]
        opts = [tb.neighbourhood(x[i], tau, s) for i, tb in enumerate(tables)]
        if any(not len(rows) for rows, _ in opts):
            return None
        out = combine([rows for rows, _ in opts], m, n)
        if out is None:
            return None
        best_t, idx, front = out
        picked = [(tb, flat) for tb, (_, flat) in zip(tables, opts)]
        # the neighbourhood's (gpus, time) Pareto front: where the GPU tie-break starts;
        # the best plan's choices built by the caller when it is the best so far
        return best_t, idx, front + (picked,)

    def _choices(self, picked, idx) -> dict[str, Choice]:
        return {self.costs[i].name: tb.choice(flat[j])
                for i, ((tb, flat), j) in enumerate(zip(picked, idx))}

    # ---- Algorithm 1 -------------------------------------------------------------------
    def candidates(self, n: int, bs: int) -> list:
        """Every (TP, DP) candidate with room in n GPUs, as (bound, dp_llm, tps, inputs),
        cheapest bound first."""
        if self.method == "fast":
            return candidate_table(self.costs, self.hw, self.llm, self.vpp, n, bs)
        tp_sets = [sorted(c.time_s) for c in self.costs]
        cands = []
        for dp_llm in divisors(bs):
            for tps in itertools.product(*tp_sets):
                if tps[self.llm] * dp_llm + sum(t for j, t in enumerate(tps) if j != self.llm) > n:
                    continue
                inputs = self._relaxed_inputs(tps, dp_llm, n, bs)
                if inputs is None:
                    continue
                lb0 = self._bound(tps, dp_llm, inputs, n, bs)
                if math.isfinite(lb0):
                    cands.append((lb0, dp_llm, tps, inputs))
        cands.sort(key=lambda z: z[0])
        return cands

    def relaxed_bound(self, tps, dp_llm, inputs, n) -> tuple[float, np.ndarray] | None:
        """(lower bound of every integer plan of the candidate within n GPUs, relaxed x):
        the convex optimum plus the LLM's warm-up constant (VPP 2 at best)."""
        if self.method == "fast":
            values, xs = self._relax_batch([(None, dp_llm, tps, inputs)], n)
            return None if not np.isfinite(values[0]) else (float(values[0]), xs[0])
        c, e, slope, lo, hi, mm = inputs
        w, wc = self._warm_terms(tps, c)
        assert self.relaxed is not None  # method 'cvxpy' builds it
        sol = self.relaxed.solve(c, e, slope, lo, hi, n, mm, w, wc)
        if sol is None:
            return None
        value, x = sol
        return value + self.costs[self.llm].time_s[tps[self.llm]] / (2 if self.vpp else 1), x

    def _relax_batch(self, cands, n) -> tuple[np.ndarray, np.ndarray]:
        """`relaxed_bound` of many candidates at once (closed form, relax.py): values (inf
        where infeasible) and x, one row per candidate."""
        warm = [self._warm_terms(tps, inputs[0]) for _, _, tps, inputs in cands]
        cols = [np.array([inp[3][f] for inp in cands]) for f in range(6)]
        c, e, slope, lo, hi, mm = cols
        values, x, ok = solve_relaxed(c, e, slope, lo, hi, n, mm, np.array([w for w, _ in warm]),
                                      np.array([wc for _, wc in warm]))
        vmax = 2 if self.vpp else 1
        llm_warm = np.array([self.costs[self.llm].time_s[tps[self.llm]] / vmax
                             for _, _, tps, _ in cands])
        return np.where(ok, values + llm_warm, np.inf), x

    def _search(self, cands, n, bs, tolerance=0.0):
        """Branch and bound over `cands` (sorted by bound): the least time T* within n
        GPUs, and every candidate that may hold a plan within T* (1 + tolerance) repaired,
        its (gpus, time) Pareto front kept. Returns (T*, plan, relaxations, repairs, fronts)."""
        best_t, best, relaxations, repairs, fronts = math.inf, None, 0, 0, []
        solved = self._solved  # fast method: relaxations solved ahead in growing batches
        for j, (lb0, dp_llm, tps, inputs) in enumerate(cands):
            limit = best_t * (1 + tolerance)
            if lb0 >= limit * (1 - 1e-9):
                break
            relaxations += 1
            if self.method == "fast":
                if j == len(solved):
                    values, xs = self._relax_batch(cands[j:j + max(64, j)], n)
                    solved += list(zip(values, xs))
                value, x = solved[j]
                if not np.isfinite(value):
                    continue
            else:
                sol = self.relaxed_bound(tps, dp_llm, inputs, n)
                if sol is None:
                    continue
                value, x = sol
            if value >= limit * (1 - 1e-9):
                continue
            c, e = inputs[0], inputs[1]
            tau = float(np.max(c / np.maximum(x, 1e-12)))
            s = float(np.max(e / np.maximum(x, 1e-12)))
            repairs += 1
            rep = self._repair(tps, dp_llm, x, tau, s, n, bs)
            if rep is None:
                continue
            fronts.append(rep[2])
            if rep[0] < best_t:
                best_t, best = rep[0], self._choices(rep[2][4], rep[1])
        return best_t, best, relaxations, repairs, fronts

    def _fewest_gpus(self, fronts: list, cap: float):
        """(time, plan) using the fewest GPUs among the repaired plans (`fronts`: each
        neighbourhood's Pareto front) within `cap`, the fastest of those."""
        best_g, best_t, best = math.inf, math.inf, None
        for gs, ts, flats, shape, picked in fronts:
            within = np.flatnonzero(ts <= cap)
            if not len(within):
                continue
            j = within[0]  # the front is sorted by gpus: the first within the cap
            if (gs[j], ts[j]) < (best_g, best_t):
                idx = np.unravel_index(int(flats[j]), shape)
                best_g, best_t = gs[j], float(ts[j])
                best = self._choices(picked, idx)
        return best_t, best

    def solve(self, num_gpus: int, global_batch: int,
              gpu_tolerance: float = 0.0, reuse: "SearchState | None" = None
              ) -> OrchestrationResult:
        """Algorithm 1: the plan of least predicted iteration time T* (DistTrain §5.1).

        Tie-break (`gpu_tolerance` = eps > 0): among plans within T* (1 + eps), the one
        using the fewest GPUs in total, then the fastest of those. The time-only objective
        spends GPUs that would otherwise idle on units off the critical path (a frozen
        encoder's warm-up shrinks by a fraction of a percent for twice the GPUs); the
        tie-break hands them back, so frozen units keep only what they need and the LLM's
        share of the used GPUs grows, as DistTrain §8.3.1 reports. Same search: candidates
        are bounded against T* (1 + eps) instead of T*, and each repaired neighbourhood
        keeps its (GPUs, time) Pareto front."""
        if gpu_tolerance < 0:
            raise ValueError(f"orchestrate: gpu_tolerance={gpu_tolerance} must be >= 0 "
                             f"(a relative slack on the iteration time, e.g. 0.01)")
        start = time.perf_counter()
        n, bs = num_gpus, global_batch
        self._priced = dict(reuse.tables) if reuse is not None else {}
        kept = reuse is not None and reuse.candidates is not None
        kept_state = cast(SearchState, reuse)  # read only when kept: reuse and its candidates
        cands = cast(list, kept_state.candidates) if kept else self.candidates(n, bs)
        self._solved = list(kept_state.relaxed) if kept else []
        best_t, best, relaxations, repairs, fronts = self._search(cands, n, bs, gpu_tolerance)
        if best is None:
            sp = smallest_plan(self.costs, self.hw, bs)
            if sp is None or sp[0] > n:
                raise PlanError(infeasible_message(self.costs, self.hw, n, bs))
            # a plan fits, yet no relaxation led to one (solver failures): never fail then
            warnings.warn(f"orchestrate: the search found no plan in {n} GPUs although one "
                          f"fits (solver failures?); returning the smallest plan that fits "
                          f"({sp[0]} GPUs), which need not be the fastest")
            best = sp[1]
            best_t = evaluate(self.costs, best, bs, self.hw).iteration_time_s
            gpu_tolerance = 0.0
        optimal_t = best_t
        if gpu_tolerance > 0:
            best_t, best = self._fewest_gpus(fronts, optimal_t * (1 + gpu_tolerance))
        return OrchestrationResult(best, best_t, time.perf_counter() - start, len(cands),
                                   relaxations, repairs, optimal_t, Frontier(self, fronts),
                                   SearchState(cands, self._priced, self._solved))


def orchestrate(costs: tuple[UnitCost, ...], hw: Hardware, num_gpus: int, global_batch: int,
                vpp: bool = True, gpu_tolerance: float = GPU_TOLERANCE,
                relaxed_factory=None, method: str = "fast",
                reuse: SearchState | None = None) -> OrchestrationResult:
    """Algorithm 1 with the fewest-GPUs tie-break (`Orchestrator.solve`); gpu_tolerance=0
    returns the least-time plan alone. `method`: "fast" (vectorised bounds, closed-form
    relaxations) or "cvxpy" (the DPP problem of record); both return the same plan."""
    return Orchestrator(costs, hw, vpp, relaxed_factory, method).solve(num_gpus, global_batch,
                                                                       gpu_tolerance, reuse)
