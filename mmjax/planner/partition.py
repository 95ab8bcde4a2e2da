"""Frozen-status-aware layer partitioning (Cornstarch §4.2) and Cornstarch's loosely-coupled
parallelisation (Cornstarch §5.2, Algorithm 1). No JAX.

A unit's layers carry (forward, backward) times; the backward already follows the frozen
rule (0 / 1 / 2 x forward, `unit_work.backward_factor`). Pipeline stages are balanced on
forward + backward, not on forward alone: a frozen encoder whose backward is skipped should
take *more* layers per stage (Cornstarch Fig. 7c). `aware=False` reproduces the
frozen-unaware baseline that assumes backward = 2 x forward everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from numba import njit

LayerCosts = Sequence[tuple[float, float]]  # (forward, backward) seconds per layer


def planning_weights(layers: LayerCosts, aware: bool = True) -> list[float]:
    """Per-layer weight to balance: fwd + bwd (aware) or 3 x fwd (unaware)."""
    return [f + b if aware else 3.0 * f for f, b in layers]


def balanced_split(weights: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of layers into `num_stages` non-empty stages minimising the largest
    stage sum (exact linear-partition dynamic programme, O(L^2 S), compiled); ties prefer
    earlier stages taking fewer layers."""
    n = len(weights)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers over num_stages={num_stages}: "
                         f"use 1..{n} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    return tuple(int(k) for k in _linear_partition(np.array(prefix), num_stages))


@njit(cache=True)
def _linear_partition(prefix, num_stages):
    n = len(prefix) - 1
    # best[s, i]: min over splits of the first i layers into s stages of the max stage sum
    best = np.full((num_stages + 1, n + 1), np.inf)
    cut = np.zeros((num_stages + 1, n + 1), np.int64)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1, j], prefix[i] - prefix[j])
                if v < best[s, i] - 1e-15:
                    best[s, i], cut[s, i] = v, j
    sizes = np.zeros(num_stages, np.int64)
    i = n
    for s in range(num_stages, 0, -1):
        j = cut[s, i]
        sizes[s - 1] = i - j
        i = j
    return sizes


def stage_times(layers: LayerCosts, split: Sequence[int]) -> list[tuple[float, float]]:
    """(forward, backward) of each stage under `split`."""
    out, start = [], 0
    for k in split:
        chunk = layers[start:start + k]
        out.append((sum(f for f, _ in chunk), sum(b for _, b in chunk)))
        start += k
    return out


def max_stage_time(layers: LayerCosts, split: Sequence[int]) -> float:
    return max(f + b for f, b in stage_times(layers, split))


@dataclass(frozen=True)
class UnitPartition:
    name: str
    split: tuple[int, ...]
    stage_fwd_s: tuple[float, ...]
    stage_bwd_s: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.split)

    @property
    def max_stage_s(self) -> float:
        return max(f + b for f, b in zip(self.stage_fwd_s, self.stage_bwd_s))


def partition_unit(name: str, layers: LayerCosts, num_stages: int,
                   aware: bool = True) -> UnitPartition:
    split = balanced_split(planning_weights(layers, aware), num_stages)
    st = stage_times(layers, split)  # actual times, whatever the split was planned on
    return UnitPartition(name, split, tuple(f for f, _ in st), tuple(b for _, b in st))


def iteration_time(parts: Sequence[UnitPartition], llm: UnitPartition,
                   num_microbatches: int) -> float:
    """1F1B over the unit DAG (encoders in parallel -> LLM): the longest chain's stages once
    (fill and drain) plus (m - 1) times the slowest stage (Cornstarch §4.1, Fig. 6)."""
    chain = max((sum(f + b for f, b in zip(p.stage_fwd_s, p.stage_bwd_s)) for p in parts),
                default=0.0)
    chain += sum(f + b for f, b in zip(llm.stage_fwd_s, llm.stage_bwd_s))
    slowest = max([llm.max_stage_s] + [p.max_stage_s for p in parts])
    return chain + (num_microbatches - 1) * slowest


@dataclass(frozen=True)
class LooselyCoupled:
    llm: UnitPartition
    encoders: tuple[UnitPartition, ...]
    iteration_time_s: float

    @property
    def stages(self) -> dict[str, int]:
        return {p.name: p.num_stages for p in (*self.encoders, self.llm)}


def loosely_coupled(llm_layers: LayerCosts, encoder_layers: Mapping[str, LayerCosts],
                    num_microbatches: int, max_total_stages: int | None = None,
                    max_unit_stages: int | None = None, aware: bool = True) -> LooselyCoupled:
    """Cornstarch Algorithm 1: for each LLM stage count i, partition the LLM (per-stage time
    t_i), give every encoder the fewest stages whose slowest stage fits t_i, and keep the
    combination with the smallest iteration time. With `aware=False` both the partitions
    and the choice use the backward = 2 x forward assumption; the returned time is always
    the actual one."""
    if not llm_layers:
        raise ValueError("loosely_coupled: the LLM has no layers")
    planned = (lambda ls: ls) if aware else (lambda ls: [(f, 2.0 * f) for f, _ in ls])
    cap = max_unit_stages or len(llm_layers)
    best, best_planned = None, float("inf")
    for i in range(1, min(cap, len(llm_layers)) + 1):
        llm_plan = partition_unit("llm", planned(llm_layers), i)
        t_i = llm_plan.max_stage_s
        enc_plans = []
        for name, layers in encoder_layers.items():
            limit = min(cap, len(layers))
            chosen = None
            for s in range(1, limit + 1):
                p = partition_unit(name, planned(layers), s)
                chosen = p
                if p.max_stage_s <= t_i:
                    break
            assert chosen is not None  # limit >= 1: an encoder has layers and cap >= 1
            enc_plans.append(chosen)
        total = i + sum(p.num_stages for p in enc_plans)
        if max_total_stages is not None and total > max_total_stages:
            continue
        t = iteration_time(enc_plans, llm_plan, num_microbatches)
        if t < best_planned - 1e-15:
            best_planned = t
            actual_llm = partition_unit("llm", llm_layers, i, aware)
            actual_encs = tuple(partition_unit(p.name, encoder_layers[p.name], p.num_stages, aware)
                                for p in enc_plans)
            best = LooselyCoupled(actual_llm, actual_encs,
                                  iteration_time(actual_encs, actual_llm, num_microbatches))
    if best is None:
        raise ValueError(f"loosely_coupled: no partition fits max_total_stages={max_total_stages}; "
                         f"allow at least {1 + len(encoder_layers)} stages")
    return best
