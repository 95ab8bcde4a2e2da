"""Integer repair of a relaxed optimum (DistTrain §5.2), vectorised with numpy (no JAX).

`OptionTable` prices every integer choice (DP_u, PP_u, VPP_u) of one unit at one TP and
LLM DP once per solve, with the formulas of evaluate.py in the same order of operations
(so the prices are bit-identical); `neighbourhood` picks, per DP_u, the PP values around
the relaxed x_u / (TP_u DP_u), the fewest stages that fit in memory and, for units whose PP
need not divide their layers, the PP meeting the relaxed stage time and the PP bringing
the unit's DP sync under the relaxed one; `combine` prices every combination of the units'
neighbourhoods and keeps the best plan and the (GPUs, time) Pareto front.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mmjax.planner.candidates import divisors, valid_pps
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, fastest_forward_backward, stage_bytes, sync_share,
                                    sync_time, variants)
from mmjax.planner.hardware import Hardware


class OptionTable:
    """Every (DP_u, PP_u, VPP_u) of one unit at TP t under LLM DP dp_llm (m microbatches):
    arrays [DP, PP, VPP] of validity, GPUs, stage, warm-up and sync time."""

    def __init__(self, cost: UnitCost, hw: Hardware, t: int, dp_llm: int, m: int, n: int,
                 is_llm: bool, vpp: bool):
        self.cost, self.hw, self.t, self.dp_llm = cost, hw, t, dp_llm
        self.valid = valid_pps(cost)
        self.dps = [dp_llm] if is_llm else [d for d in divisors(dp_llm) if t * d <= n]
        self.vs = (1, 2) if vpp and is_llm else (1,)
        dp = np.array(self.dps, dtype=np.float64)[:, None, None]
        pp = np.array(self.valid, dtype=np.float64)[None, :, None]
        v = np.array(self.vs, dtype=np.float64)[None, None, :]
        spr = dp_llm / dp
        flight = np.where(v == 1, np.minimum(m, pp), np.minimum(m, ((v + 1) * pp - 1) / v))
        # per option the least-recompute remat variant that fits (evaluate.remat_variant)
        self._variants = variants(cost)
        pick = np.full(np.broadcast_shapes(dp.shape, pp.shape, v.shape), -1)
        for k, vc in enumerate(self._variants):
            fits_k = stage_bytes(vc, t, dp, pp, spr, flight) <= hw.hbm_bytes
            pick = np.where((pick < 0) & fits_k, k, pick)
        self._pick = pick
        fits = pick >= 0
        times = np.array([vc.time_s[t] for vc in self._variants])[np.maximum(pick, 0)]
        time = cost.time_s[t]
        self.gpus = t * dp * pp + 0 * v
        self.stage = spr * times / pp + 0 * v
        self.m = m
        self._per_option: tuple | None = None
        self._near: dict = {}  # `neighbourhood` per relaxed optimum
        self._fwd_bwd0 = fastest_forward_backward(cost, t)  # `bound_terms`' (pick.py)
        self.warm = spr * times / v + pp * (spr * cost.boundary_bytes / hw.nic_bw)
        bw = np.where(dp * t <= hw.gpus_per_node, hw.nvlink_bw, hw.nic_bw)
        if cost.grad_bytes == 0:
            self.sync = np.zeros_like(self.gpus)
        else:
            self.sync = np.where(dp == 1, 0.0,
                                 2 * (dp - 1) / dp * cost.grad_bytes / (t * pp) / bw
                                 * sync_share(cost)) + 0 * v
        vpp_ok = (v == 1) | ((pp > 1) & (cost.num_layers % (pp * v) == 0) & (m % pp == 0))
        self.ok = fits & vpp_ok & (self.gpus <= n)
        # the fewest stages that fit in memory at VPP 1, per DP (len(valid): none fits)
        fit1 = fits[:, :, 0]
        self._fewest = np.where(fit1.any(axis=1), np.argmax(fit1, axis=1), len(self.valid))
        fewest = self._fewest[:, None]
        idx = np.arange(len(self.valid))[None, :]
        # what `neighbourhood` always picks: the fewest stages that fit and the next; and
        # only options of a DP at which some PP fits
        self._near_fewest = (idx >= fewest) & (idx < fewest + 2)
        self._ok_fitting = self.ok & (fewest < len(self.valid))[:, :, None]
        self._sync1 = np.array([sync_time(cost, Choice(t, d, 1), hw) for d in self.dps])
        self._base = np.array([dp_llm / d * time for d in self.dps])  # stage time x tau
        self._dp_arr, self._pp_arr = np.asarray(self.dps), np.asarray(self.valid)
        self._idx = np.arange(len(self.valid))[None, :]
        self._prices = np.stack([self.gpus, self.stage, self.warm, self.sync],
                                axis=-1).reshape(-1, 4)

    def neighbourhood(self, x_star: float, tau_star: float, s_star: float):
        """(rows [options, 4] of gpus, stage, warm-up, sync; their flat (DP, PP, VPP)
        indices, for `choice`) of the PPs around the relaxed optimum, in that order; kept
        per relaxed optimum (a re-solve that keeps this table repairs the same ones)."""
        key = (x_star, tau_star, s_star)
        if key not in self._near:
            self._near[key] = self._neighbourhood(x_star, tau_star, s_star)
        return self._near[key]

    def _neighbourhood(self, x_star: float, tau_star: float, s_star: float):
        cost, idx = self.cost, self._idx
        cut = np.searchsorted(self._pp_arr, x_star / (self.t * self._dp_arr), side="right")
        cut = cut[:, None]
        pick = ((idx >= cut - 2) & (idx < cut + 2)) | self._near_fewest
        if not cost.layer_pp_divides:  # valid = 1..layers: PP p sits at index p - 1
            if tau_star > 0:
                pick |= idx == np.minimum(cost.num_layers,
                                          np.ceil(self._base / tau_star))[:, None] - 1
            if s_star > 0:
                p = np.minimum(cost.num_layers, np.ceil(self._sync1 / s_star))
            else:
                p = np.full(len(self._sync1), cost.num_layers)
            pick |= (idx == p[:, None] - 1) & (self._sync1 > 0)[:, None]
        sel = (self._ok_fitting & pick[:, :, None]).ravel()
        return self._prices[sel], np.flatnonzero(sel)

    def per_option(self) -> tuple:
        """`options` and `bound_terms` of every flat option, 13 arrays (built on first use:
        a frontier reads a table's options in many of its fronts)."""
        if self._per_option is None:
            every = np.arange(self.ok.size)
            self._per_option = self.options(every) + self.bound_terms(every)
        return self._per_option

    def options(self, opt: np.ndarray) -> tuple:
        """(tp, dp, pp, vpp, remat variant index) arrays of the flat option indices `opt`:
        what `choice` builds, for frontier_memory.py."""
        _, npp, nv = self.ok.shape
        j, p, w = opt // (npp * nv), opt // nv % npp, opt % nv
        return (np.full(len(opt), self.t), self._dp_arr[j], self._pp_arr[p], np.asarray(self.vs)[w],
                self._pick[j, p, w])

    def bound_terms(self, opt: np.ndarray) -> tuple:
        """The schedule's lower-bound terms (pick.py `schedule_lower_bound`) at the flat
        option indices `opt`, per microbatch at the fastest policy: all microbatches' busy
        time of one physical stage, the whole unit's forward and backward, its sync,
        virtual stages, stages, one virtual stage's forward + backward and one transfer."""
        _, npp, nv = self.ok.shape
        dp = self._dp_arr.astype(np.float64)[opt // (npp * nv)]
        pp = self._pp_arr.astype(np.float64)[opt // nv % npp]
        v = np.asarray(self.vs, dtype=np.float64)[opt % nv]
        spr = self.dp_llm / dp
        fwd0, bwd0 = self._fwd_bwd0
        return (self.m * (spr * (fwd0 + bwd0) / pp), spr * fwd0, spr * bwd0,
                self.sync.ravel()[opt], pp * v, pp, spr * (fwd0 + bwd0) / (pp * v),
                spr * self.cost.boundary_bytes / self.hw.nic_bw)

    def choice(self, flat: int) -> Choice:
        """The Choice of an option by its flat (DP, PP, VPP) index (from `neighbourhood`)."""
        _, npp, nv = self.ok.shape  # the flat index's (DP, PP, VPP), C order
        flat = int(flat)
        j, p, w = flat // (npp * nv), flat // nv % npp, flat % nv
        remat = self._variants[self._pick[j, p, w]].remat if self.cost.variants else None
        return Choice(self.t, self.dps[j], self.valid[p], self.vs[w], remat)


def combine(arrays, m: int, n: int):
    """Price every combination of the units' options (rows [options, 4] per unit): the
    best (time, index tuple) and the (gpus, time) Pareto front (gpus, times, flat indices,
    shape), or None when no combination fits in n GPUs."""
    shape = [len(a) for a in arrays]
    # broadcast up one unit's axis at a time: floats, then arrays from the first axis on
    g: Any
    stage: Any
    warm: Any
    sync: Any
    g = stage = warm = sync = 0.0
    for ax, a in enumerate(arrays):
        view = [1] * len(shape)
        view[ax] = len(a)
        cols = a.T.reshape([4] + view)
        if ax == 0:
            g, stage, warm, sync = cols
            continue
        g = g + cols[0]
        stage = np.maximum(stage, cols[1])
        warm = warm + cols[2]
        sync = np.maximum(sync, cols[3])
    total = warm + (m - 1) * stage + sync
    total[g > n] = np.inf
    flat = int(np.argmin(total))
    if not np.isfinite(total.flat[flat]):
        return None
    where = np.flatnonzero(np.isfinite(total))
    gs, ts, keep = pareto_front(g.ravel()[where], total.ravel()[where])
    return (float(total.flat[flat]), np.unravel_index(flat, shape),
            (gs, ts, where[keep], shape))


def pareto_front(gpus: np.ndarray, times: np.ndarray):
    """The (GPUs, time) Pareto front of plans with integral GPU counts: (gpus, times,
    indices) of the plans no plan with as few GPUs beats, by GPUs ascending -- the least
    time per GPU count (the first such plan on a tie) where it is below every smaller
    count's. What sorting by (GPUs, time) and keeping each new least time gives, without
    the sort: a plan not the least of its count is never kept."""
    if not len(gpus):
        return gpus, times, np.zeros(0, dtype=np.int64)
    gi = gpus.astype(np.int64)
    least = np.full(int(gi.max()) + 1, np.inf)
    np.minimum.at(least, gi, times)
    counts = np.flatnonzero(np.isfinite(least))
    lt = least[counts]
    front = counts[lt < np.minimum.accumulate(np.concatenate(([np.inf], lt[:-1])))]
    on_front = np.zeros(len(least), dtype=bool)
    on_front[front] = True
    idx = np.flatnonzero(on_front[gi] & (times == least[gi]))
    first = np.full(len(least), len(idx))  # per GPU count, its first plan of least time
    np.minimum.at(first, gi[idx], np.arange(len(idx)))
    keep = idx[first[front]]
    return gpus[keep], times[keep], keep
