"""The LLM's context parallelism and overlapped tensor parallelism, priced (no JAX).

Context parallelism (Cornstarch §4.3, §5.3: each CP rank keeps 1/cp of every sequence's
tokens and all-gathers K/V per layer) is folded into the orchestrator's TP dimension: the
LLM's cost at CP size cp is keyed by the group size tp * cp (so Algorithm 1 counts its GPUs
and keeps the group inside a node), with compute, residuals and working set / cp, the K/V
all-gather added to the time, the parameters replicated over CP (pre-multiplied by cp so the
group's division leaves / tp) and the ZeRO-1 state split over dp x cp as
parallel/zero.py does. `plan_model` tries cp > 1 only for long sequences or when nothing
fits without it, and keeps it only where it is faster.

Overlapped TP (DistTrain §7, StepCCL; parallel/collective_matmul.py): the decomposed
matmuls hide the TP collectives behind compute at the cost of smaller matmul pieces;
`overlap_pays` compares the two per layer with the cost model.

ZeRO-2/3 of a pipelined unit (`zero_cost`; memory: planner/memory.py `zero_terms`): ZeRO-2
reduce-scatters each microbatch's float32 partial gradients at the end of its backward
(exposed: nothing of that program is left to hide it); ZeRO-3 all-gathers every layer's
compute-dtype weights in the forward and again in the backward (when the layers run one)
and reduce-scatters their gradients, layer by layer inside the scan, a layer's gather
hidden behind the previous layer's compute: exposed max(0, traffic - compute) + one
layer's. Traffic per microbatch of one sample (the LLM's; an upper bound for a unit whose
rank takes several samples per microbatch, whose compute grows but not its gathers) at
NVLink bandwidth, (d-1)/d taken as 1: a ZeRO group inside a node. The step's sync shrinks
accordingly (evaluate.py `sync_time`).
"""
from __future__ import annotations

import dataclasses

from mmjax.planner.costs import UnitCost, unit_params
from mmjax.planner.memory import ACC_BYTES, FROZEN_BYTES, SCORE_BUFFERS
from mmjax.planner.unit_work import ACT_BYTES, Work, unit_work
from mmjax.planner.hardware import Hardware

CP_SIZES = (2, 4, 8)
LONG_SEQUENCE = 32768  # mean LLM tokens per sample from which CP is tried
DECOMPOSE_OVERHEAD = 0.05  # compute slowdown of the decomposed (chunked) matmuls


def kv_gather_s(model, tokens: float, tp: int, cp: int, hw: Hardware) -> float:
    """Seconds per sample of one layer's K/V all-gather over the CP group (forward; the
    backward reduce-scatters the same volume)."""
    c = model.llm
    volume = 2 * c.num_kv_heads * c.dim_per_head * tokens * ACT_BYTES / tp
    return 2 * (cp - 1) / cp * volume / hw.nvlink_bw


def cp_cost(model, wl, cost: UnitCost, cp: int, hw: Hardware) -> UnitCost:
    """The LLM `cost` (with or without remat variants) at context-parallel size `cp`,
    keyed by the group size tp * cp (only groups within a node)."""
    if cp == 1:
        return cost
    tokens = wl.llm_moments()[0]

    def one(c: UnitCost) -> UnitCost:
        keep = [t for t in c.time_s if t * cp <= hw.gpus_per_node]
        gather = lambda t: c.num_layers * kv_gather_s(model, tokens, t, cp, hw)
        return dataclasses.replace(
            c, time_s={t * cp: c.time_s[t] / cp + 2 * gather(t) for t in keep},
            fwd_s={t * cp: c.fwd_s[t] / cp + gather(t) for t in keep},
            activation_bytes={t * cp: c.activation_bytes[t] / cp for t in keep},
            work_bytes={t * cp: c.work_bytes.get(t, 0.0) / cp for t in keep},
            fixed_bytes={t * cp: c.fixed_bytes.get(t, 0.0) / cp for t in keep},
            input_bytes=c.input_bytes / cp, weight_bytes=c.weight_bytes * cp,
            step_weight_bytes=(None if c.step_weight_bytes is None
                               else c.step_weight_bytes * cp),
            replicated=0.0, variants={})

    out = one(cost)
    if cost.variants:
        out = dataclasses.replace(out, variants={p: one(v) for p, v in cost.variants.items()})
    return out


def overlap_time(w: Work, tp: int, hw: Hardware) -> tuple[float, float]:
    """(plain, overlapped) forward seconds of one piece at `tp`: the TP collectives after
    the matmuls, or hidden behind the decomposed matmuls (DistTrain §7)."""
    compute = w.flops / (tp * hw.peak_flops * hw.efficiency(w.width / tp, w.tokens, w.kind))
    comm = 0.0 if tp == 1 else 2 * (tp - 1) / tp * w.allreduce_bytes / hw.nvlink_bw
    slower = compute * (1 + DECOMPOSE_OVERHEAD)
    return compute + comm, slower + max(0.0, comm - slower)


def overlap_pays(model, wl, tp: int, hw: Hardware, attention_impl=None) -> bool:
    """Whether the LLM's layers at `tp` run faster with overlapped TP."""
    if tp < 2:
        return False
    layers = unit_work(model, wl, "llm", attention_impl).layers
    plain = sum(overlap_time(w, tp, hw)[0] for w in layers)
    return sum(overlap_time(w, tp, hw)[1] for w in layers) < plain


def with_zero(cost: UnitCost, zero: int, group: int = 0) -> UnitCost:
    """`cost` (and its remat variants) at ZeRO stage `zero` over groups of `group` dp ranks
    (0: all): its memory terms only (evaluate.py `stage_bytes`); `zero_cost` adds the
    traffic to the times. At ZeRO-3 each variant carries its `scan` view (`_scan_view`)."""
    def one(v: UnitCost) -> UnitCost:
        z = dataclasses.replace(v, zero_stage=zero, zero_group=group)
        return dataclasses.replace(z, scan=_scan_view(z, cost)) if zero == 3 else z

    out = one(cost)
    if cost.variants:
        out = dataclasses.replace(out, variants={p: one(v) for p, v in cost.variants.items()})
    return out


def _scan_view(v: UnitCost, cost: UnitCost) -> UnitCost | None:
    """Variant `v` of `cost` with its activation terms as a ZeRO-3 stage runs them (dp > 1:
    every layer checkpointed under "dots" in the gathering scan,
    memory.py `scan_checkpoint_acts`), from `cost`'s "none" and "dots" variants (None
    without them: the plain terms stand)."""
    if not cost.variants:
        return None
    none, dots = cost.variants["none"], cost.variants["dots"]
    layers = max(cost.num_layers, 1)
    act, work, fixed = {}, {}, {}
    for t in v.time_s:
        n, d = none.activation_bytes.get(t, 0.0), dots.activation_bytes.get(t, 0.0)
        scores = max(none.fixed_bytes.get(t, 0.0) - dots.fixed_bytes.get(t, 0.0),
                     0.0) / SCORE_BUFFERS
        one = (n - d) / layers + scores
        act[t] = 0.0 if v.remat == "full" else d
        work[t] = d + one if v.remat == "full" else one
        fixed[t] = dots.fixed_bytes.get(t, 0.0)  # the stage input and output: as "dots"
    return dataclasses.replace(v, activation_bytes=act, work_bytes=work, fixed_bytes=fixed,
                               input_bytes=v.input_bytes if v.remat == "full"
                               else dots.input_bytes, scan=None)


def zero_exposed_s(cost: UnitCost, tp: int, zero: int, hw: Hardware) -> tuple[float, float]:
    """(forward, backward) seconds of ZeRO traffic one sample's microbatch leaves exposed
    on the whole unit at `tp` (module docstring)."""
    if zero == 1:
        return 0.0, 0.0
    t, f = unit_params(cost)
    share = (1 - cost.replicated) / tp + cost.replicated
    fwd = cost.fwd_s.get(tp, cost.time_s[tp] / 3)
    bwd = cost.time_s[tp] - fwd
    if zero == 2:
        return 0.0, ACC_BYTES * t * share / hw.nvlink_bw if t else 0.0
    layers = max(cost.num_layers, 1)
    weights = (cost.dtype_bytes * t + FROZEN_BYTES * f) * share / hw.nvlink_bw
    backward = bwd > 0.1 * fwd  # the layers run a backward (planner/colocated.py's test)
    g_b = (weights + cost.dtype_bytes * t * share / hw.nvlink_bw) if backward else 0.0
    exposed = lambda traffic, compute: max(0.0, traffic - compute) + traffic / layers
    return exposed(weights, fwd), (exposed(g_b, bwd) if backward else 0.0)


def zero_cost(cost: UnitCost, zero: int, hw: Hardware) -> UnitCost:
    """`cost` at ZeRO stage `zero`: `with_zero`'s memory terms and its exposed traffic
    (`zero_exposed_s`) added to the forward and backward times, per TP size and remat
    variant."""
    if zero == 1:
        return cost

    def one(c: UnitCost) -> UnitCost:
        ex = {t: zero_exposed_s(c, t, zero, hw) for t in c.time_s}
        return dataclasses.replace(
            c, time_s={t: c.time_s[t] + sum(ex[t]) for t in c.time_s},
            fwd_s={t: c.fwd_s[t] + ex[t][0] for t in c.fwd_s})

    timed = one(cost)
    if cost.variants:
        timed = dataclasses.replace(timed, variants={p: one(v)
                                                     for p, v in cost.variants.items()})
    return with_zero(timed, zero)
