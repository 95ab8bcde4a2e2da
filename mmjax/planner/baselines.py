"""Baseline orchestrations priced by the same model as the planner (DistTrain §8.1, §8.2.1).

- Megatron-LM's rigid plan (DistTrain §2.1, Fig. 2): the LLM on TP x PP x DP; every encoder
  and the generator is one extra pipeline stage with the LLM's TP and DP. TP = 8 and the
  LLM's PP as in the papers' runs (DistTrain §8.1: 1/2/10 for MLLM-9B/15B/72B; OrchMLLM §8.1:
  2/4/10), raised to the next divisor of the layers when it does not fit in memory.
- The FLOPs-ratio plan (DistTrain §8.2.1): GPUs shared in proportion to each module's FLOPs;
  the LLM at TP 8, the other units at the smallest valid TP, replicated by DP (then PP) to
  fill their share.
"""
from __future__ import annotations

from mmjax.planner.build import model_costs, to_plan
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice, choice_error
from mmjax.planner.hardware import Hardware
from mmjax.planner.orchestrate import divisors
from mmjax.planner.plan import PlanError
from mmjax.models.units import is_llm

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
        errors = [f"{c.name}: {choice_error(c, choices[c.name], dp, m, hw)}" for c in costs
                  if choice_error(c, choices[c.name], dp, m, hw)]
        if not errors:
            return choices
        last_error = f"pp={p}, dp={dp}: " + "; ".join(errors)
    raise PlanError(f"Megatron baseline does not fit {num_gpus} GPUs: {last_error}")


def _fill(cost: UnitCost, tp: int, budget: int, dp_llm: int, m: int,
          hw: Hardware) -> Choice | None:
    """Most GPUs within `budget` (DP first, then PP) that fit in memory; else the fewest."""
    opts = []
    for dp in divisors(dp_llm):
        for p in (divisors(cost.num_layers) if cost.layer_pp_divides
                  else range(1, cost.num_layers + 1)):
            ch = Choice(tp, dp, p)
            if choice_error(cost, ch, dp_llm, m, hw) is None:
                opts.append(ch)
    if not opts:
        return None
    within = [c for c in opts if c.gpus <= budget]
    if within:
        return max(within, key=lambda c: (c.gpus, c.dp))
    return min(opts, key=lambda c: (c.gpus, -c.dp))


def ratio_choices(costs: tuple[UnitCost, ...], hw: Hardware, num_gpus: int,
                  global_batch: int, tp: int = 8) -> dict[str, Choice]:
    total = sum(c.flops for c in costs)
    llm = next(c for c in costs if is_llm(c.name))
    tp_llm = _largest_tp(llm, tp)
    share = {c.name: c.flops / total for c in costs}
    best = None
    for dp in divisors(global_batch):
        m = global_batch // dp
        # the other units keep at least the fewest GPUs they fit in at this microbatching
        least = [_fill(c, min(c.time_s), 0, dp, m, hw) for c in costs if not is_llm(c.name)]
        if any(ch is None for ch in least):
            continue
        reserve = sum(ch.gpus for ch in least)
        budget_llm = max(tp_llm, min(int(share["llm"] * num_gpus), num_gpus - reserve))
        for p in divisors(llm.num_layers):
            ch = Choice(tp_llm, dp, p)
            if ch.gpus <= budget_llm and choice_error(llm, ch, dp, m, hw) is None:
                if best is None or (ch.gpus, -p) > (best.gpus, -best.pp):
                    best = ch
    if best is None:
        raise PlanError(f"ratio baseline: the LLM does not fit its FLOPs share of "
                        f"{int(share['llm'] * num_gpus)} GPUs at tp={tp_llm}: add GPUs")
    choices = {"llm": best}
    m = global_batch // best.dp
    for c in costs:
        if is_llm(c.name):
            continue
        budget = max(min(c.time_s), int(share[c.name] * num_gpus))
        ch = _fill(c, min(c.time_s), budget, best.dp, m, hw)
        if ch is None:
            raise PlanError(f"ratio baseline: unit {c.name!r} fits in memory with no "
                            f"dp dividing {best.dp}: add GPUs")
        choices[c.name] = ch
    used = sum(ch.gpus for ch in choices.values())
    if used > num_gpus:
        raise PlanError(f"ratio baseline needs {used} GPUs; have {num_gpus}: add "
                        f"{used - num_gpus} GPUs")
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
