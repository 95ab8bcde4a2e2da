"""The orchestrator's (TP, DP) candidates and their cheap lower bounds, vectorised (no JAX).

Same candidates, relaxation inputs and bounds as the scalar `Orchestrator` methods
(`_relaxed_inputs`, `_bound`, `_share_bound`; DistTrain §5.2), computed for every
(LLM DP, TP per unit) at once with numpy: arrays [candidates, units] for the relaxation
inputs and [candidates, LLM PP] for the bound, where the LLM's PP is enumerated exactly and
the other units share the remaining GPUs in closed form.
"""
from __future__ import annotations

import itertools

import numpy as np

from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (per_tp, leanest, stage_bytes, state_need, sync_share,
                                    variants)
from mmjax.planner.hardware import Hardware


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_pps(cost: UnitCost) -> list[int]:
    return (divisors(cost.num_layers) if cost.layer_pp_divides
            else list(range(1, cost.num_layers + 1)))


def share_bound(c, lo, hi, room):
    """Smallest tau with sum_u max(lo_u, c_u / tau) <= room and c_u / tau <= hi_u, per row
    (c, lo, hi [..., u], room [...]): the largest C_S / (room - L_rest) over the prefixes S
    of the units sorted by c / lo (each is a lower bound; the consistent one is attained)."""
    if c.shape[-1] == 0:
        return np.zeros(np.shape(room))
    order = np.argsort(-(c / lo), axis=-1, kind="stable")
    cs = np.take_along_axis(c, order, -1)
    ls = np.take_along_axis(lo, order, -1)
    c_pre = np.cumsum(cs, axis=-1)
    lo_rest = np.sum(ls, axis=-1, keepdims=True) - np.cumsum(ls, axis=-1)
    den = room[..., None] - lo_rest
    with np.errstate(divide="ignore", invalid="ignore"):
        taus = np.where(den > 0, c_pre / den, 0.0)
        floor = np.max(c / hi, axis=-1)
    tau = np.maximum(np.max(taus, axis=-1), floor)
    return np.where(np.sum(lo, axis=-1) > room, np.inf, tau)


def _unit_inputs(cost: UnitCost, hw: Hardware, dps, is_llm: bool, bs: int):
    """Per (LLM DP, TP of the unit): c, e, slope, lo, hi and whether activations fit."""
    tps = np.array(sorted(cost.time_s), dtype=np.float64)
    time = np.array([cost.time_s[int(t)] for t in tps])
    lean = leanest(cost)
    act1 = np.array([lean.activation_bytes[int(t)] for t in tps])
    d = dps[:, None]
    m = bs // dps
    c = d * tps * time
    dp_lo = d if is_llm else np.ones_like(d)
    slope = (cost.boundary_bytes / hw.nic_bw) / (tps * d)
    e = np.zeros_like(c)
    if is_llm and cost.grad_bytes:
        bw = np.where(d * tps <= hw.gpus_per_node, hw.nvlink_bw, hw.nic_bw)
        e = np.where(d > 1, 2 * (d - 1) * cost.grad_bytes / bw, 0.0) * sync_share(cost)
    act = act1 * np.minimum(1.0, m[:, None] / cost.num_layers)
    room = hw.hbm_bytes - act
    with np.errstate(divide="ignore"):
        need = state_need(cost, dp_lo) / room
    lo = np.maximum(tps * dp_lo, need)
    hi = tps * d * cost.num_layers
    return tps, c, e, slope, lo, hi, room > 0


def _llm_terms(cost: UnitCost, hw: Hardware, vpp: bool, dp, tp, mm, lo_rest_sum, n):
    """Per (candidate row, LLM PP), for VPP 1 and 2: whether the LLM fits (memory, GPUs
    left for the other units' least), its GPUs, stage time and warm-up + DP sync, each
    option at the least-recompute remat variant that fits (evaluate.remat_variant), so the
    bound is the LLM's exact price."""
    pps = np.array(valid_pps(cost), dtype=np.float64)[None, :]
    d, t, m = dp[:, None], tp[:, None], (mm + 1)[:, None]
    options = variants(cost)
    times = np.stack([per_tp(vc.time_s, tp) for vc in options])  # [K, rows]
    rows = np.arange(len(tp))[:, None]
    gpus = t * d * pps
    room = gpus + lo_rest_sum[:, None] <= n

    def first_fit(v):
        flight = np.minimum(m, pps) if v == 1 else np.minimum(m, ((v + 1) * pps - 1) / v)
        pick = np.full(np.broadcast_shapes(t.shape, pps.shape), -1)
        for k, vc in enumerate(options):
            fits = stage_bytes(vc, t, d, pps, 1.0, flight) <= hw.hbm_bytes
            pick = np.where((pick < 0) & fits, k, pick)
        return pick >= 0, times[np.maximum(pick, 0), rows]

    p2p = 1.0 * cost.boundary_bytes / hw.nic_bw
    if cost.grad_bytes:
        bw = np.where(d * t <= hw.gpus_per_node, hw.nvlink_bw, hw.nic_bw)
        sync = np.where(d > 1, 2 * (d - 1) / d * cost.grad_bytes / (t * pps) / bw,
                        0.0) * sync_share(cost)
    else:
        sync = np.zeros_like(gpus)
    out = []
    for v in ((1, 2) if vpp else (1,)):
        fits, time = first_fit(v)
        if v == 2:
            fits &= (pps > 1) & (cost.num_layers % (2 * pps) == 0) & (m % pps == 0)
        out.append((room & fits, gpus, time / pps, time / v + pps * p2p, sync))
    return out


def _llm_bound(cost: UnitCost, hw: Hardware, vpp: bool, dp, tp, mm, lo_rest_sum, n,
               c_rest, lo_rest, hi_rest):
    """min over the LLM's PP and VPP of (m-1) tau + warm-up + sync per candidate row, the
    other units sharing the GPUs left in closed form (`share_bound`)."""
    best = None
    for ok, gpus, stage, warm, sync in _llm_terms(cost, hw, vpp, dp, tp, mm, lo_rest_sum, n):
        share = share_bound(c_rest[:, None, :], lo_rest[:, None, :], hi_rest[:, None, :],
                            n - gpus)
        with np.errstate(invalid="ignore"):  # 0 x inf where the LLM leaves no room (masked)
            val = mm[:, None] * np.maximum(stage, share) + warm + sync
        val = np.min(np.where(ok, val, np.inf), axis=1)
        best = val if best is None else np.minimum(best, val)
    return best


def candidate_table(costs: tuple[UnitCost, ...], hw: Hardware, llm: int, vpp: bool, n: int,
                    bs: int) -> list:
    """Every (TP, DP) candidate with room in n GPUs as (bound, dp_llm, tps, inputs), the
    cheapest bound first (ties in enumeration order), as `Orchestrator.candidates`."""
    dps = np.array(divisors(bs), dtype=np.float64)
    per = [_unit_inputs(c, hw, dps, i == llm, bs) for i, c in enumerate(costs)]
    combos = np.array(list(itertools.product(*[range(len(p[0])) for p in per])), dtype=int)
    k, nd, nc = len(costs), len(dps), len(combos)
    di = np.repeat(np.arange(nd), nc)  # rows: dp-major, then TP combos (enumeration order)
    ci = np.tile(np.arange(nc), nd)
    pick = [(di, combos[ci, u]) for u in range(k)]
    tps = np.stack([per[u][0][pick[u][1]] for u in range(k)], axis=1)
    c, e, slope, lo, hi = (np.stack([per[u][f][pick[u]] for u in range(k)], axis=1)
                           for f in range(1, 6))
    room_ok = np.all(np.stack([per[u][6][pick[u]] for u in range(k)], axis=1), axis=1)
    dp = dps[di]
    rest = np.arange(k) != llm
    gpus0 = tps[:, llm] * dp + np.sum(tps[:, rest], axis=1)
    keep = np.flatnonzero((gpus0 <= n) & room_ok)
    mm = (bs // dp[keep] - 1).astype(np.float64)
    lb = _llm_bound(costs[llm], hw, vpp, dp[keep], tps[keep, llm], mm,
                    np.sum(lo[keep][:, rest], axis=1), n, c[keep][:, rest],
                    lo[keep][:, rest], hi[keep][:, rest])
    others = np.zeros(len(keep))
    for u in np.flatnonzero(rest):
        others = others + per_tp(costs[u].time_s, tps[keep, u])
    lb = others + lb
    fin = np.flatnonzero(np.isfinite(lb))
    order = fin[np.argsort(lb[fin], kind="stable")]
    rows = keep[order]
    tps_l = tps[rows].astype(int).tolist()
    return [(b, d, tuple(t), inputs) for b, d, t, inputs in
            zip(lb[order].tolist(), dp[rows].astype(int).tolist(), tps_l,
                zip(c[rows], e[rows], slope[rows], lo[rows], hi[rows],
                    mm[order].astype(int).tolist()))]
