"""Baseline orchestrations priced by the same model as the planner (DistTrain §8.1, §8.2.1).

- Megatron-LM's rigid plan (DistTrain §2.1, Fig. 2): the LLM on TP x PP x DP; every encoder
  and the generator is one extra pipeline stage with the LLM's TP and DP. TP = 8 and the
  LLM's PP as in the papers' runs (DistTrain §8.1: 1/2/10 for MLLM-9B/15B/72B; OrchMLLM §8.1:
  2/4/10), raised to the next divisor of the layers when it does not fit in memory (its
  own repair: more pipeline stages).
- The FLOPs-ratio plan (DistTrain §8.2.1): GPUs shared in proportion to each module's FLOPs;
  the LLM at TP 8, the other units at the smallest valid TP, replicated by DP (then PP) to
  fill their share; a unit that does not fit in its share gets the fewest more GPUs it
  fits in (its own repair), and the plan does not fit when they are not there.

Memory is checked with the count every plan is reported with (evaluate.runtime_memory: the
runtime's in-flight microbatches, so an encoder also holds the LLM's depth); a baseline
that cannot be repaired raises `BaselineDoesNotFit` saying why.
"""
from __future__ import annotations

from typing import cast

import numpy as np

from mmjax.planner.build import model_costs, to_plan
from mmjax.planner.candidates import valid_pps
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice, over_memory, stage_bytes, variants
from mmjax.planner.hardware import Hardware
from mmjax.planner.orchestrate import divisors
from mmjax.planner.plan import PlanError
from mmjax.models.units import UnitDag, is_encoder, is_llm


class BaselineDoesNotFit(PlanError):
    """A baseline whose method finds no plan that fits the GPUs and their memory."""

PAPER_PP = {"disttrain/mllm_9b": 1, "disttrain/mllm_15b": 2, "disttrain/mllm_72b": 10,
            "orchmllm/mllm_10b": 2, "orchmllm/mllm_18b": 4, "orchmllm/mllm_84b": 10}


def _largest_tp(cost: UnitCost, at_most: int) -> int:
    valid = [t for t in cost.time_s if t <= at_most]
    if not valid:
        raise PlanError(f"unit {cost.name!r}: no valid tp <= {at_most} "
                        f"(valid: {sorted(cost.time_s)})")
    return max(valid)


def megatron_choices(costs: tuple[UnitCost, ...], hw: Hardware, num_gpus: int,
                     global_batch: int, tp: int = 8, pp: int | None = None,
                     model_name: str = "") -> dict[str, Choice]:
    llm = next(c for c in costs if is_llm(c.name))
    others = [c for c in costs if not is_llm(c.name)]
    tp_llm = _largest_tp(llm, tp)
    first = pp or PAPER_PP.get(model_name, 1)
    last_error = "no pipeline size tried"
    for p in [d for d in divisors(llm.num_layers) if d >= first]:
        stages = p + len(others)
        dps = [d for d in divisors(global_batch) if tp_llm * d * stages <= num_gpus]
        if not dps:
            last_error = (f"pp={p} needs at least {tp_llm * stages} GPUs "
                          f"(tp={tp_llm} x {stages} stages); have {num_gpus}")
            break
        dp = dps[-1]
        m = global_batch // dp
        choices = {"llm": Choice(tp_llm, dp, p)}
        for c in others:
            choices[c.name] = Choice(_largest_tp(c, tp_llm), dp, 1)
        over = over_memory(costs, choices, global_batch, hw)
        if not over:
            return choices
        last_error = f"pp={p}, dp={dp}: " + ", ".join(
            f"{u} needs {b / 1e9:.1f} GB per GPU" for u, b in over.items())
        del m
    raise BaselineDoesNotFit(f"Megatron baseline does not fit {num_gpus} GPUs of "
                             f"{hw.hbm_bytes / 1e9:.0f} GB: {last_error}")


def _fits(cost: UnitCost, tp: int, dp_llm: int, m: int, hw: Hardware, after: int):
    """(dps, pps, fits [dp, pp]): the unit's choices at `tp` (dp | dp_llm, any valid pp)
    that fit with the runtime's in-flight count, `after` virtual stages downstream (an
    encoder holds min(m, pp + after) microbatches; the LLM and generator, vpp 1, their own
    1F1B count plus `after`), at any remat policy."""
    dps = np.array(divisors(dp_llm), dtype=np.float64)[:, None]
    pps = np.array(valid_pps(cost), dtype=np.float64)[None, :]
    flight = np.minimum(m, pps + after) if is_encoder(cost.name) else np.minimum(
        m, np.minimum(m, pps) + after)
    fits = np.zeros(np.broadcast_shapes(dps.shape, pps.shape), dtype=bool)
    for v in variants(cost):
        fits |= stage_bytes(v, tp, dps, pps, dp_llm / dps, flight, exact=True) <= hw.hbm_bytes
    return dps[:, 0].astype(int), pps[0].astype(int), fits


def _fill(cost: UnitCost, tp: int, budget: int, dp_llm: int, m: int, hw: Hardware,
          after: int) -> Choice | None:
    """Most GPUs within `budget` (DP first, then PP) that fit in memory; else the fewest
    that fit (the unit's repair: more GPUs); None when none fits."""
    dps, pps, fits = _fits(cost, tp, dp_llm, m, hw, after)
    if not fits.any():
        return None
    di, pi = np.nonzero(fits)
    gpus, dp = tp * dps[di] * pps[pi], dps[di]
    within = gpus <= budget
    if within.any():  # the most GPUs, then the largest dp
        k = np.lexsort((dp[within], gpus[within]))[-1]
        k = np.flatnonzero(within)[k]
    else:  # the fewest GPUs, then the largest dp
        k = np.lexsort((-dp, gpus))[0]
    return Choice(tp, int(dps[di[k]]), int(pps[pi[k]]))


def ratio_choices(costs: tuple[UnitCost, ...], hw: Hardware, num_gpus: int,
                  global_batch: int, tp: int = 8) -> dict[str, Choice]:
    total = sum(c.flops for c in costs)
    llm = next(c for c in costs if is_llm(c.name))
    tp_llm = _largest_tp(llm, tp)
    share = {c.name: c.flops / total for c in costs}
    dag = UnitDag.of([c.name for c in costs])
    by_name = {c.name: c for c in costs}
    gens = [by_name[u] for u in dag.successors("llm")]  # downstream of the LLM
    encs = [c for c in costs if not is_llm(c.name) and c not in gens]
    best = None
    ch: Choice | None  # the LLM's candidates here, then each unit's fill (None: none fits)
    for dp in divisors(global_batch):
        if tp_llm * dp > max(tp_llm, num_gpus):  # no LLM choice within its budget
            continue
        m = global_batch // dp
        # the other units keep at least the fewest GPUs they fit in at this microbatching
        least_gen = [_fill(c, min(c.time_s), 0, dp, m, hw, 0) for c in gens]
        if any(ch is None for ch in least_gen):
            continue
        after_llm = max((ch.pp for ch in cast("list[Choice]", least_gen)), default=0)  # no None
        dps, pps, fits = _fits(llm, tp_llm, dp, m, hw, after_llm)
        least_enc = [_fill(c, min(c.time_s), 0, dp, m, hw, after_llm + int(pps[-1]))
                     for c in encs]
        if any(ch is None for ch in least_enc):
            continue
        reserve = sum(ch.gpus for ch in cast("list[Choice]", least_gen + least_enc))  # no None
        budget_llm = max(tp_llm, min(int(share["llm"] * num_gpus), num_gpus - reserve))
        row = list(dps).index(dp)
        for j, p in enumerate(pps):
            ch = Choice(tp_llm, dp, int(p))
            if ch.gpus <= budget_llm and fits[row, j]:
                if best is None or (ch.gpus, -p) > (best.gpus, -best.pp):
                    best = ch
    if best is None:
        raise BaselineDoesNotFit(f"ratio baseline: the LLM does not fit its FLOPs share of "
                                 f"{int(share['llm'] * num_gpus)} GPUs at tp={tp_llm}: add "
                                 f"GPUs")
    choices: dict[str, Choice] = {"llm": best}
    after: dict[str, int] = {}
    m = global_batch // best.dp
    for name in reversed(dag.names):  # downstream first: an encoder holds the LLM's depth
        after[name] = max((choices[v].pp * choices[v].vpp + after[v]
                           for v in dag.successors(name)), default=0)
        if is_llm(name):
            continue
        c = by_name[name]
        budget = max(min(c.time_s), int(share[c.name] * num_gpus))
        ch = _fill(c, min(c.time_s), budget, best.dp, m, hw, after[name])
        if ch is None:
            raise BaselineDoesNotFit(f"ratio baseline: unit {c.name!r} fits in memory with "
                                     f"no dp dividing {best.dp}: add GPUs")
        choices[c.name] = ch
    choices = {c.name: choices[c.name] for c in costs}
    used = sum(ch.gpus for ch in choices.values())
    if used > num_gpus:
        raise BaselineDoesNotFit(f"ratio baseline needs {used} GPUs to fit in memory; have "
                                 f"{num_gpus}: add {used - num_gpus} GPUs")
    over = over_memory(costs, choices, global_batch, hw)
    if over:
        raise BaselineDoesNotFit("ratio baseline does not fit: " + ", ".join(
            f"{u} needs {b / 1e9:.1f} GB per GPU" for u, b in over.items()))
    return choices


def baseline_plan(model, kind: str, hw: Hardware, num_gpus: int, global_batch: int,
                  workload=None, recompute="auto", pp: int | None = None):
    """The `kind` ("megatron" or "ratio") baseline as a validated, priced `Plan`."""
    costs, layer_costs = model_costs(model, hw, workload, recompute)
    if kind == "megatron":
        choices = megatron_choices(costs, hw, num_gpus, global_batch, pp=pp,
                                   model_name=model.name)
        return to_plan(model, costs, choices, global_batch, hw, "rigid", layer_costs)
    if kind == "ratio":
        choices = ratio_choices(costs, hw, num_gpus, global_batch)
        return to_plan(model, costs, choices, global_batch, hw, "ratio", layer_costs)
    raise ValueError(f"baseline kind={kind!r}: choose 'megatron' or 'ratio'")
