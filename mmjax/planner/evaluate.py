"""Predicted iteration time of an integer parallelisation (DistTrain §5.1, Eq. 1-2), no JAX.

The LLM runs microbatches of one sample per DP rank, so a global batch of BS samples is
m = BS / DP_llm pipeline microbatches of DP_llm samples each; unit u splits each microbatch
over its own DP_u ranks (DP_u divides DP_llm). With C_u(TP) the forward+backward time of
one sample through the whole unit:

    T_u      = (DP_llm / DP_u) * C_u(TP_u) / PP_u                 (one stage, one microbatch)
    T_warmup = sum_u (DP_llm / DP_u) * C_u(TP_u) / VPP_u + PP comm  (Eq. 1; VPP, §5.2)
    T_steady = max_u T_u * (m - 1)                                  (Eq. 2)
    T_iter   = T_warmup + T_steady + max_u (DP gradient sync of u)

PP communication: PP_u times one boundary tensor over the NIC (§5.1). Memory per GPU: the
runtime's buffers (planner/memory.py): TP x PP shards weights and accumulators, ZeRO-1 also
shards the optimizer state over DP, and the first stage keeps min(m, PP) microbatches of
residuals (1F1B; more with interleaving) under the unit's remat policy.
Everything here is shared by the orchestrator, the baselines and the exhaustive search in
the tests, so all three price a plan identically.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmjax.planner.costs import UnitCost, unit_params
from mmjax.planner.hardware import Hardware
from mmjax.planner.memory import (ACC_BYTES, FROZEN_BYTES, unit_stage_bytes, zero_divisors,
                                  zero_terms)
from mmjax.models.units import UnitDag, is_encoder


@dataclass(frozen=True)
class Choice:
    """Integer parallelism of one unit."""

    tp: int
    dp: int
    pp: int
    vpp: int = 1
    remat: str | None = None  # the unit's remat policy; None: the cost's own, or the
    #                            least-recompute variant that fits (`remat_variant`)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp


def samples_per_rank(c: Choice, dp_llm: int) -> float:
    return dp_llm / c.dp


def stage_time(cost: UnitCost, c: Choice, dp_llm: int) -> float:
    return samples_per_rank(c, dp_llm) * cost.time_s[c.tp] / c.pp


def p2p_time(cost: UnitCost, c: Choice, dp_llm: int, hw: Hardware) -> float:
    """One stage-to-stage transfer of a microbatch's boundary tensor."""
    return samples_per_rank(c, dp_llm) * cost.boundary_bytes / hw.nic_bw


def warmup_time(cost: UnitCost, c: Choice, dp_llm: int, hw: Hardware) -> float:
    return (samples_per_rank(c, dp_llm) * cost.time_s[c.tp] / c.vpp
            + c.pp * p2p_time(cost, c, dp_llm, hw))


def sync_share(cost: UnitCost) -> float:
    """The share of ZeRO-1's per-step sync the unit's ZeRO stage keeps (`sync_time`)."""
    return {1: 1.0, 2: 0.5, 3: 0.0}[cost.zero_stage]


def state_need(cost: UnitCost, dp):
    """Bytes x GPUs the unit's parameter-sized state needs at `dp` ranks (the candidate
    bounds' numerator: / its GPUs <= HBM - activations): ZeRO-1 shards the weights over
    tp x pp only (x dp copies), ZeRO-2 the accumulators over dp too, ZeRO-3 everything (a
    lower bound: its gathered layers are left out)."""
    if cost.zero_stage == 1 or cost.step_weight_bytes is None:
        return cost.weight_bytes * dp + cost.optimizer_bytes
    t, f = unit_params(cost)
    z = zero_terms(t, f, cost.dtype_bytes, cost.zero_stage, 1)  # / dp at dp = 1: whole
    if cost.zero_stage == 2:  # the accumulators sharded, the rest copied per dp rank
        return (cost.weight_bytes - ACC_BYTES * t) * dp + z.accumulators + cost.optimizer_bytes
    return z.params + z.frozen + z.accumulators + z.backward + cost.optimizer_bytes


def sync_time(cost: UnitCost, c: Choice, hw: Hardware) -> float:
    """ZeRO-1 gradient reduce-scatter + parameter all-gather over the unit's DP group, once
    per step; at ZeRO-2 the all-gather alone (each backward reduce-scatters: knobs.py
    `zero_cost` prices it in the stage time), at ZeRO-3 nothing (no all-gather: the layers
    are gathered in the scan)."""
    if c.dp == 1 or cost.grad_bytes == 0 or cost.zero_stage == 3:
        return 0.0
    full = 2 * (c.dp - 1) / c.dp * cost.grad_bytes / (c.tp * c.pp) / hw.group_bw(c.dp * c.tp)
    return full / 2 if cost.zero_stage == 2 else full


def in_flight(c: Choice, num_microbatches: int) -> float:
    """Microbatches (in stage units) whose activations the first stage holds."""
    if c.vpp == 1:
        return min(num_microbatches, c.pp)
    return min(num_microbatches, ((c.vpp + 1) * c.pp - 1) / c.vpp)


def per_tp(table: dict, tp):
    """`table[tp]` for an int or an array of TP sizes (0 where absent)."""
    if isinstance(tp, int):
        return table.get(tp, 0.0)
    arr = np.asarray(tp)
    if arr.ndim == 0:
        return table.get(int(arr), 0.0)
    idx = arr.astype(np.int64)  # TP sizes: small integers; a lookup row indexed by them
    lut = np.zeros(max(int(idx.max(initial=0)), max(table, default=0)) + 1)
    for k, v in table.items():
        lut[k] = v
    return lut[idx]


def stage_bytes(cost: UnitCost, tp, dp, pp, spr, flight, exact: bool = False):
    """Bytes per GPU of one stage of `cost`'s unit (numpy-broadcastable over the choice):
    planner/memory.py `unit_stage_bytes`, the runtime's buffers (run and optimizer step).
    The orchestrator's `flight` (the unit's own 1F1B count) is scaled by the cost's
    `flight_scale`; `exact`: `flight` is the runtime's count already."""
    k = 1.0 if exact else cost.flight_scale
    weight, step_weight, gathered, zdp = _zero_weights(cost, dp)

    def on(c: UnitCost):
        return unit_stage_bytes(weight, c.optimizer_bytes,
                                k * per_tp(c.activation_bytes, tp), k * c.input_bytes,
                                per_tp(c.work_bytes, tp), per_tp(c.fixed_bytes, tp),
                                step_weight, c.replicated, tp, zdp, pp, spr, flight,
                                c.dtype_bytes, c.zero_stage, gathered)
    if cost.scan is None:
        return on(cost)
    many = zdp > 1  # ZeRO-3 gathers in the scan, each layer checkpointed, only with dp > 1
    if isinstance(many, np.ndarray):
        return np.where(many, on(cost.scan), on(cost))
    return on(cost.scan) if many else on(cost)


def zero_dp(cost: UnitCost, dp):
    """The ranks a unit's ZeRO state is sharded over: its ZeRO group, or all `dp`."""
    return np.minimum(dp, cost.zero_group) if cost.zero_group else dp


def _zero_weights(cost: UnitCost, dp):
    """(weight, step_weight, gathered, ZeRO ranks) of `unit_stage_bytes` at the cost's ZeRO
    stage (planner/memory.py `zero_terms`); the cost's own terms at ZeRO-1."""
    zdp = zero_dp(cost, dp)
    if cost.zero_stage == 1 or cost.step_weight_bytes is None:
        return cost.weight_bytes, cost.step_weight_bytes, 0.0, zdp
    t, f = unit_params(cost)
    b = cost.dtype_bytes
    per_param = (b * t + FROZEN_BYTES * f) / max(t + f, 1.0)  # gathered bytes per parameter
    layer = per_param * (cost.layer_params or (t + f) / max(cost.num_layers, 1))
    z = zero_terms(t, f, b, cost.zero_stage, zdp, layer)
    weight = z.params + z.frozen + z.accumulators + np.maximum(z.forward, z.backward)
    return (weight, z.params + z.frozen + b * t / zero_divisors(cost.zero_stage, zdp)[1],
            np.maximum(z.gathered_forward, z.gathered_backward), zdp)


def variants(cost: UnitCost) -> list[UnitCost]:
    """The unit under each remat policy it may take, least recompute (fastest) first."""
    return list(cost.variants.values()) if cost.variants else [cost]


FORWARD_SHARE = 1 / 3  # forward : backward = 1 : 2 where a cost gives no forward time


def forward_backward(cost: UnitCost, tp: int) -> tuple[float, float]:
    """(forward, backward) seconds of one sample through the whole unit at `tp`."""
    whole = cost.time_s[tp]
    fwd = cost.fwd_s.get(tp, FORWARD_SHARE * whole)
    return fwd, whole - fwd


def fastest_forward_backward(cost: UnitCost, tp: int) -> tuple[float, float]:
    """The least forward and the least backward over the unit's remat policies: what a
    lower bound of the schedule may assume whichever policy the plan runs."""
    pairs = [forward_backward(v, tp) for v in variants(cost)]
    return min(f for f, _ in pairs), min(b for _, b in pairs)


def leanest(cost: UnitCost) -> UnitCost:
    """The variant keeping the fewest activations ("full" when variants exist): what the
    candidate bounds assume, so they stay lower bounds."""
    return cost.variants.get("full", cost) if cost.variants else cost


def _bytes(cost: UnitCost, c: Choice, dp_llm: int, num_microbatches: int) -> float:
    return float(stage_bytes(cost, c.tp, c.dp, c.pp, samples_per_rank(c, dp_llm),
                             in_flight(c, num_microbatches)))


def remat_variant(cost: UnitCost, c: Choice, dp_llm: int, num_microbatches: int,
                  hbm: float | None = None) -> UnitCost:
    """The cost `c` runs: its `remat` variant when set, else the first of `variants` (none,
    dots, full: the least recompute) that fits in `hbm` bytes, else the leanest."""
    if not cost.variants:
        return cost
    if c.remat is not None:
        return cost.variants[c.remat]
    options = variants(cost)
    if hbm is not None:
        for v in options:
            if _bytes(v, c, dp_llm, num_microbatches) <= hbm:
                return v
    return min(options, key=lambda v: _bytes(v, c, dp_llm, num_microbatches))


def pipeline_in_flight(choices: dict[str, Choice], num_microbatches: int,
                       dag: UnitDag | None = None) -> dict:
    """Per unit, the microbatches (in stage units) its first stage holds under the runtime's
    schedule (schedule/schedule.py `multimodal_one_f_one_b`): a stage warms up with as many
    forwards as there are virtual stages from it to the end of its path, so an encoder also
    holds the LLM's and the generator's depth; `in_flight` counts the unit's own alone.
    The depth after each unit is read off the model's `UnitDag` (`dag`: the caller's,
    when it prices many plans of one model)."""
    m, dag = num_microbatches, dag or UnitDag.of(choices)
    after: dict[str, int] = {}  # virtual stages downstream of each unit
    for name in reversed(dag.names):
        after[name] = max((choices[v].pp * choices[v].vpp + after[v]
                           for v in dag.successors(name)), default=0)
    out: dict[str, float] = {}
    for name, c in choices.items():
        if is_encoder(name):  # an encoder's own chunks are not interleaved in the count
            out[name] = min(m, c.pp + after[name])
        else:
            out[name] = min(m, in_flight(c, m) + after[name] / c.vpp)
    return out


def memory_bytes(cost: UnitCost, c: Choice, dp_llm: int, num_microbatches: int) -> float:
    """Bytes per GPU of `c`'s first stage; with remat variants and no `c.remat`, the
    leanest variant's (whether any policy fits)."""
    return _bytes(remat_variant(cost, c, dp_llm, num_microbatches), c, dp_llm,
                  num_microbatches)


def choice_error(cost: UnitCost, c: Choice, dp_llm: int, num_microbatches: int,
                 hw: Hardware) -> str | None:
    """Why `c` cannot run this unit, or None."""
    if c.tp not in cost.time_s:
        return f"tp={c.tp} not in the unit's valid sizes {sorted(cost.time_s)}"
    if dp_llm % c.dp:
        return f"dp={c.dp} does not divide the LLM's dp={dp_llm}"
    if not 1 <= c.pp <= cost.num_layers or (cost.layer_pp_divides and cost.num_layers % c.pp):
        return f"pp={c.pp} does not split {cost.num_layers} layers"
    if c.vpp > 1 and (c.pp == 1 or cost.num_layers % (c.pp * c.vpp)
                      or num_microbatches % c.pp):
        return f"vpp={c.vpp} needs pp>1, pp*vpp | layers and pp | microbatches"
    mem = memory_bytes(cost, c, dp_llm, num_microbatches)
    if mem > hw.hbm_bytes:
        return f"needs {mem / 1e9:.1f} GB per GPU; have {hw.hbm_bytes / 1e9:.0f} GB"
    return None


def runtime_memory(costs: tuple[UnitCost, ...], choices: dict[str, Choice],
                   global_batch: int, hw: Hardware, dag: UnitDag | None = None
                   ) -> tuple[tuple[UnitCost, ...], dict]:
    """(each unit's cost at the remat policy it runs, its first stage's bytes per GPU): the
    one memory count of every plan the planner prices, picks or reports (its own and the
    baselines'). The in-flight microbatches are the runtime schedule's
    (`pipeline_in_flight`: an encoder also holds the LLM's and the generator's depth); the
    policy is the choice's `remat`, else the least recompute that fits by this count, else
    the leanest."""
    m = global_batch // choices["llm"].dp
    dp_llm = choices["llm"].dp
    flights = pipeline_in_flight(choices, m, dag)
    out, need = [], {}
    for cost in costs:
        c = choices[cost.name]

        def nbytes(v: UnitCost) -> float:
            return float(stage_bytes(v, c.tp, c.dp, c.pp, samples_per_rank(c, dp_llm),
                                     flights[cost.name], exact=True))
        if c.remat is not None and cost.variants:
            pick = cost.variants[c.remat]
        else:
            options = variants(cost)
            pick = next((v for v in options if nbytes(v) <= hw.hbm_bytes), None)
            if pick is None:
                pick = min(options, key=nbytes)
        out.append(pick)
        need[cost.name] = nbytes(pick)
    return tuple(out), need


def over_memory(costs: tuple[UnitCost, ...], choices: dict[str, Choice], global_batch: int,
                hw: Hardware) -> dict[str, float]:
    """The units whose first stage does not fit (`runtime_memory`), with their bytes."""
    _, need = runtime_memory(costs, choices, global_batch, hw)
    return {u: b for u, b in need.items() if b > hw.hbm_bytes}


@dataclass(frozen=True)
class Evaluation:
    iteration_time_s: float
    warmup_s: float
    steady_s: float
    sync_s: float
    stage_time_s: dict[str, float]
    memory_gb: dict[str, float]  # first stage, with the runtime's in-flight microbatches
    gpus: int
    mfu: float


def evaluate(costs: tuple[UnitCost, ...], choices: dict[str, Choice], global_batch: int,
             hw: Hardware) -> Evaluation:
    """Price an integer plan by the closed form; `choices["llm"].dp` sets the
    microbatching; each unit at the remat policy `runtime_memory` picks."""
    dp_llm = choices["llm"].dp
    m = global_batch // dp_llm
    costs, need = runtime_memory(costs, choices, global_batch, hw)
    warm = sum(warmup_time(c, choices[c.name], dp_llm, hw) for c in costs)
    stages = {c.name: stage_time(c, choices[c.name], dp_llm) for c in costs}
    steady = max(stages.values()) * (m - 1)
    sync = max(sync_time(c, choices[c.name], hw) for c in costs)
    total = warm + steady + sync
    gpus = sum(choices[c.name].gpus for c in costs)
    flops = global_batch * sum(c.flops for c in costs)
    memory = {u: b / 1e9 for u, b in need.items()}
    return Evaluation(total, warm, steady, sync, stages, memory, gpus,
                      flops / (total * gpus * hw.peak_flops))
