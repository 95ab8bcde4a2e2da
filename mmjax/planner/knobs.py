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
"""
from __future__ import annotations

import dataclasses

from mmjax.planner.costs import UnitCost
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
