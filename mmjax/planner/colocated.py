"""Cost and memory model of the co-located layout (OrchMLLM §4-7), and its best plan (no JAX).

Every unit runs on all G GPUs, data-parallel over them (the LLM and each encoder at dp G/tp x
its own tp, the sizes nested: each divides the next; the generator at its smallest valid
tp), phases in order: each encoder's forward, the LLM's
forward and backward, the generator, then the encoders' backward. The global batch of B
samples is post-balanced per phase (OrchMLLM §5), so a rank holds B/dp_u samples of unit u
(times `imbalance`, max/mean tokens per rank: ~1.0 balanced, scripts/bench_colocated.py part
1 for the loaded mini-batches); when they do not fit, the step runs k micro-steps of
ceil(B / dp_u / k) samples (gradient accumulation).

Per unit, ZeRO stage z, as the co-located runner holds its state (parallel/fsdp.py: float32
parameters, which are the master copy, AdamW's m and v, float32 gradients; per GPU, P
trainable and F frozen parameters one tp rank holds, b the compute dtype's bytes):
  z = 1: parameters 4 P and gradients 4 P whole, m and v 8 P / dp; the gradients are
         all-reduced once per step, after the backward (2 (dp-1)/dp x 4 P per GPU).
  z = 2: the gradients sharded too, 4 P / dp (reduce-scattered; the updated parameters
         all-gathered): the same traffic, one sync per step.
  z = 3: everything sharded, 16 P / dp and 4 F / dp, plus two layers' gathered weights;
         each micro-step all-gathers every layer's float32 weights in the forward and
         again in the backward (when the layers run one) and reduce-scatters its float32
         gradients, layer by layer, overlapping the compute: a layer's gather hides behind
         the previous layer's compute, so a unit's exposed time is max(0, traffic -
         compute) + one layer's.
Stages 1-2 also hold the step's compute-dtype copy of the parameters (b P, none in
float32). "Replicated" (`state_bytes` at z = 1, dp = 1) is 16 P + 4 F: stage 3 at dp d
holds 1/d of it plus two layers.
Memory at remat "none" / "dots" (what the runner runs: every layer under the scan's "dots"
checkpoint) is planner/colocated_memory.py's peak, checked against the compiled step
(`unit_load`); the terms below price "full".
Collectives over all G GPUs run at `Hardware.group_bw(G)`. Activations: per micro-step, the
encoders' residuals stay live through the LLM (their backward runs last), so the peak holds
the encoders' and the LLM's (and generator's) residuals together, plus one backward's
working set. The encoder->LLM all-to-all (one per encoder, rearrangement composition, §6)
moves each encoder output row once forward and its cotangent once back; every tp replica
of the receiving rank gets it (one replica of the sender sends it), so per GPU the forward
moves the rows of B tp_llm / G samples and the backward those of B tp_enc / G; (G-1)/G of
it leaves the GPU, the part crossing nodes at the NIC.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from mmjax.models.units import is_encoder, is_llm
from mmjax.planner.costs import UnitCost, unit_params
from mmjax.planner.hardware import Hardware
from mmjax.planner.plan import PlanError
from mmjax.planner.colocated_memory import UnitLoad, colocated_memory
from mmjax.planner.memory import (ADAM_BYTES, F32, FROZEN_BYTES, REMATS, SCORE_BUFFERS,
                                  ZERO_STAGES, Acts)

def _share(cost: UnitCost, tp: int) -> float:
    return (1 - cost.replicated) / tp + cost.replicated


def state_bytes(cost: UnitCost, tp: int, dp: int, zero: int) -> float:
    """Per-GPU bytes of a unit's parameters, gradients and optimizer state at ZeRO `zero`
    (module docstring); at stage 3 with two layers' full weights gathered."""
    if zero not in ZERO_STAGES:
        raise PlanError(f"zero_stage={zero!r}: use one of {ZERO_STAGES}")
    t, f = unit_params(cost)
    s = _share(cost, tp)
    params = (F32 * t + FROZEN_BYTES * f) * s
    opt = ADAM_BYTES * t * s / dp
    grads = F32 * t * s
    if zero == 1:
        return params + grads + opt
    if zero == 2:
        return params + grads / dp + opt
    layer = F32 * (t + f) * s / max(cost.num_layers, 1)
    return (params + grads) / dp + opt + 2 * layer


def compute_copy_bytes(cost: UnitCost, tp: int, zero: int) -> float:
    """The step's compute-dtype copy of the parameters at stages 1-2 (none in float32; at
    stage 3 the gathered layers are cast one at a time)."""
    if zero == 3 or cost.dtype_bytes >= F32:
        return 0.0
    t, f = unit_params(cost)
    return cost.dtype_bytes * (t + f) * _share(cost, tp)


def layers_in_backward(cost: UnitCost, tp: int) -> bool:
    """Whether the unit's layers run a backward (trainable, or frozen with something
    trainable upstream: Cornstarch §4.2): its backward time is more than a tenth of its
    forward. A frozen encoder whose projector alone trains does not."""
    fwd = cost.fwd_s.get(tp, 0.0)
    return fwd == 0.0 or cost.time_s[tp] - fwd > 0.1 * fwd


def gather_bytes(cost: UnitCost, tp: int, dp: int) -> float:
    """ZeRO-3 traffic per GPU of one micro-step: each layer's float32 weights all-gathered
    in the forward and, when the layers run a backward, again in it, plus the trainable
    parameters' gradient reduce-scatter ((dp-1)/dp of the full size each)."""
    t, f = unit_params(cost)
    s = _share(cost, tp)
    frac = (dp - 1) / dp
    again = layers_in_backward(cost, tp)
    return frac * s * F32 * ((t + f) * (1 + again) + t)


def sync_bytes(cost: UnitCost, tp: int, dp: int) -> float:
    """ZeRO-1/2 traffic per GPU per step: the float32 gradients' all-reduce (or reduce-
    scatter then the parameters' all-gather), 2 (dp-1)/dp of them."""
    t, _ = unit_params(cost)
    return 2 * (dp - 1) / dp * F32 * t * _share(cost, tp)


@dataclass(frozen=True)
class ColocatedEvaluation:
    """A priced co-located plan (seconds per iteration and its parts, GB per GPU)."""

    iteration_time_s: float
    gpus: int
    tp: dict[str, int]
    zero: dict[str, int]
    remat: str
    micro_steps: int
    compute_s: dict[str, float]
    exposed_comm_s: dict[str, float]  # per unit: ZeRO-3 gathers not hidden, step syncs
    all_to_all_s: float
    memory_gb: float
    mfu: float
    samples_per_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def _residuals(c: UnitCost, v: UnitCost, tp: int, remat: str) -> tuple[float, float]:
    """(kept per sample, one backward's rebuilt working set per sample). "none" / "dots":
    the cost's own terms. "full" is per-layer checkpointing inside the layer scan (what a
    ZeRO-3 unit's scan runs): every layer's input kept, one layer's residuals rebuilt at a
    time. A layer's input is the LLM's / generator's boundary tensor (one hidden-state
    stream); for an encoder it is estimated as 1/12 of a layer's residuals (a ViT layer keeps
    11 hidden-size tensors and the FFN's; an over-estimate at FFN 4x)."""
    if remat != "full" or not c.variants:
        return v.activation_bytes.get(tp, 0.0) + v.input_bytes, v.work_bytes.get(tp, 0.0)
    none = c.variants["none"].activation_bytes.get(tp, 0.0)
    layers = max(v.num_layers, 1)
    if none == 0.0:  # forward-only (frozen, nothing trainable upstream): nothing kept
        return 0.0, 0.0
    layer_in = v.boundary_bytes if not is_encoder(c.name) else none / layers / 12
    return layers * layer_in, none / layers


def unit_load(c: UnitCost, tp: int, dp: int, zero: int, samples: float) -> UnitLoad:
    """planner/colocated_memory.py's terms of one unit from its cost's remat variants, as
    the co-located runner runs it: every layer under the scan's "dots" checkpoint
    (models/scan.py: the gather context sets it), so it keeps the "dots" residuals and
    rebuilds one layer's "none" residuals at a time; the score buffers are what the "none"
    variant's fixed bytes hold beyond the "dots" one's (SCORE_BUFFERS of them)."""
    none = c.variants.get("none", c) if c.variants else c
    dots = c.variants.get("dots", c) if c.variants else c
    acts = Acts(none=none.activation_bytes.get(tp, 0.0), dots=dots.activation_bytes.get(tp, 0.0),
                scores=max(none.fixed_bytes.get(tp, 0.0) - dots.fixed_bytes.get(tp, 0.0), 0.0)
                / SCORE_BUFFERS, boundary=c.boundary_bytes, input=dots.input_bytes)
    t, f = unit_params(c)
    s = _share(c, tp)
    layers = max(c.num_layers, 1)
    return UnitLoad(c.name, t * s, f * s, (t + f) * s / layers, layers, zero, dp, samples,
                    acts, compute_bytes=c.dtype_bytes)


def _a2a_bw(hw: Hardware, g: int) -> float:
    """Per-rank all-to-all bandwidth over g GPUs: the (g-1) peers, those on other nodes at
    the NIC, the rest over NVLink (time per byte, inverted)."""
    if g <= 1:
        return math.inf
    on = min(g, hw.gpus_per_node) - 1
    off = g - 1 - on
    per_byte = (on / hw.nvlink_bw + off / hw.nic_bw) / (g - 1)
    return 1.0 / per_byte


def evaluate_colocated(costs: tuple[UnitCost, ...], num_gpus: int, global_batch: int,
                       hw: Hardware, tp: dict[str, int], zero: dict[str, int],
                       remat: str = "none", micro_steps: int = 1,
                       imbalance: float | dict[str, float] = 1.0) -> ColocatedEvaluation:
    """Price one co-located choice (module docstring). Raises PlanError when a unit's tp
    is not valid for it or does not divide the GPUs."""
    g, notes = num_gpus, []
    comp, exposed, mem_state, acts, work = {}, {}, 0.0, 0.0, 0.0
    a2a = 0.0
    flops = 0.0
    loads = []
    for c in costs:
        v = c.variants.get(remat, c) if c.variants else c
        t = tp.get(c.name, 1)
        if t not in v.time_s or g % t:
            raise PlanError(f"unit {c.name!r}: tp={t} is not valid (valid: "
                             f"{sorted(v.time_s)}, dividing {g} GPUs)")
        dp = g // t
        z = zero.get(c.name, 1)
        imb = imbalance.get(c.name, 1.0) if isinstance(imbalance, dict) else imbalance
        spr = global_batch / dp * imb
        per_step = math.ceil(global_batch / dp / micro_steps)
        comp[c.name] = spr * v.time_s[t]
        t_params, _ = unit_params(v)
        if z == 3 and dp > 1:
            traffic = gather_bytes(v, t, dp) / hw.group_bw(g)
            one = comp[c.name] / micro_steps
            exposed[c.name] = micro_steps * (max(0.0, traffic - one)
                                             + traffic / max(v.num_layers, 1))
        elif dp > 1 and t_params > 0:
            exposed[c.name] = sync_bytes(v, t, dp) / hw.group_bw(g)
        else:
            exposed[c.name] = 0.0
        mem_state += state_bytes(v, t, dp, z) + compute_copy_bytes(v, t, z)
        loads.append(unit_load(c, t, dp, z, per_step))
        kept, rebuilt = _residuals(c, v, t, remat)
        acts += per_step * kept
        work = max(work, per_step * (rebuilt + v.fixed_bytes.get(t, 0.0)))
        if is_encoder(c.name):  # forward to every LLM tp replica, backward to every own
            rows = (tp.get("llm", 1) + t) * global_batch / g * imb
            a2a += rows * v.boundary_bytes * (g - 1) / g / _a2a_bw(hw, g)
        flops += global_batch * v.flops
    total = sum(comp.values()) + sum(exposed.values()) + a2a
    # "none" / "dots": the runner's per-layer "dots" checkpoint (colocated_memory's terms,
    # checked against the compiled step); "full": every layer's input kept, one rebuilt
    mem = (colocated_memory(loads).peak if remat != "full"
           else mem_state + acts + work)
    if mem > hw.hbm_bytes:
        notes.append(f"needs {mem / 1e9:.1f} GB per GPU; have {hw.hbm_bytes / 1e9:.0f} GB")
    return ColocatedEvaluation(total, g, dict(tp), dict(zero), remat, micro_steps, comp,
                               exposed, a2a, mem / 1e9, flops / (total * g * hw.peak_flops),
                               global_batch / total, notes)


def best_colocated(costs: tuple[UnitCost, ...], num_gpus: int, global_batch: int,
                   hw: Hardware, zero_stages=ZERO_STAGES,
                   imbalance: float | dict[str, float] = 1.0,
                   max_micro_steps: int | None = None) -> ColocatedEvaluation:
    """The fastest co-located choice that fits in memory: the LLM's and each encoder's tp
    (nested: each divides the next; other units at their smallest valid tp), one ZeRO stage
    per unit, one remat policy, the fewest micro-steps that fit (at most
    `max_micro_steps`: 1 for the co-located runner, which steps the whole global batch at
    once). Ties go to the lower ZeRO stage, then the smaller tp. Raises PlanError naming
    what is short."""
    names = [c.name for c in costs]
    by = {c.name: c for c in costs}
    llm_tps = sorted(t for t in by["llm"].time_s if num_gpus % t == 0)
    if not llm_tps:
        raise PlanError(f"co-located: no valid LLM tp divides {num_gpus} GPUs "
                         f"(valid: {sorted(by['llm'].time_s)})")
    best, smallest = None, None
    # a bound from below per tp choice and remat: compute and the all-to-all (free of
    # ZeRO stage and micro-steps) plus each unit's least exposed communication over the
    # stages at one micro-step (more only repeat the gathers); visit the cheapest first and
    # skip what cannot beat the incumbent
    bounds = []
    for tp in tp_choices(costs, num_gpus):
        by_remat = {}
        for r in REMATS:
            evs = [evaluate_colocated(costs, num_gpus, global_batch, hw, tp,
                                      dict.fromkeys(names, z), r, 1, imbalance)
                   for z in sorted({min(zero_stages), max(zero_stages)})]
            by_remat[r] = (sum(evs[0].compute_s.values()) + evs[0].all_to_all_s
                           + sum(min(e.exposed_comm_s[n] for e in evs) for n in names))
        bounds.append((min(by_remat.values()), tp, by_remat))
    bounds.sort(key=lambda b: (b[0], sum(b[1].values())))
    for bound, tp, by_remat in bounds:
        if best is not None and bound > best.iteration_time_s:
            break
        max_k = max(1, math.ceil(global_batch / (num_gpus // tp["llm"])))
        for zs in itertools.product(zero_stages, repeat=len(names)):
            zero = dict(zip(names, zs))
            for remat in REMATS:
                if best is not None and by_remat[remat] > best.iteration_time_s:
                    continue
                for k in [k for k in _micro_steps(max_k)
                          if max_micro_steps is None or k <= max_micro_steps]:
                    ev = evaluate_colocated(costs, num_gpus, global_batch, hw, tp, zero,
                                            remat, k, imbalance)
                    if smallest is None or ev.memory_gb < smallest.memory_gb:
                        smallest = ev
                    if ev.notes:
                        continue
                    key = (ev.iteration_time_s, sum(zs), sum(tp.values()))
                    if best is None or key < (best.iteration_time_s, sum(best.zero.values()),
                                              sum(best.tp.values())):
                        best = ev
                    break  # more micro-steps only add gathers
    if best is None:
        assert smallest is not None  # the search evaluates at least one choice
        raise PlanError(f"co-located: nothing fits {num_gpus} GPUs; the leanest choice "
                         f"(tp {smallest.tp}, ZeRO {smallest.zero}, remat "
                         f"{smallest.remat}, {smallest.micro_steps} micro-steps) "
                         f"{smallest.notes[0]}")
    return best


def tp_choices(costs: tuple[UnitCost, ...], num_gpus: int) -> list[dict[str, int]]:
    """Every per-unit tp the co-located runner can run: the LLM and each encoder at a valid
    tp dividing the GPUs, the sizes above 1 nested (each divides the next:
    train/colocated_plan.py), other units at their smallest valid tp."""
    options = []
    for c in costs:
        valid = sorted(t for t in c.time_s if num_gpus % t == 0)
        if not valid:
            raise PlanError(f"co-located: no valid tp of unit {c.name!r} divides {num_gpus} "
                             f"GPUs (valid: {sorted(c.time_s)})")
        options.append(valid if is_llm(c.name) or is_encoder(c.name) else valid[:1])
    out = []
    for combo in itertools.product(*options):
        sizes = sorted(set(combo))
        if all(b % a == 0 for a, b in zip(sizes, sizes[1:])):
            out.append(dict(zip((c.name for c in costs), combo)))
    return out


def _micro_steps(max_k: int) -> list[int]:
    """1, 2, 4, ... up to max_k, and max_k itself (one sample per micro-step)."""
    out, k = [], 1
    while k < max_k:
        out.append(k)
        k *= 2
    return out + [max_k]
