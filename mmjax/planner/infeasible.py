"""When no plan fits: the smallest plan that fits in memory, and a one-line message saying
what is short (memory per GPU, or how many GPUs) and by how much."""
from __future__ import annotations

from mmjax.planner.candidates import divisors, valid_pps
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice, evaluate, memory_bytes, stage_time
from mmjax.planner.hardware import Hardware
from mmjax.models.units import is_llm


def _fewest_gpus_choice(cost: UnitCost, hw: Hardware, dp_llm: int, m: int, is_llm: bool):
    """The unit's choice (VPP 1) with the fewest GPUs that fits in memory, or None."""
    valid, best = valid_pps(cost), None
    for tp in sorted(cost.time_s):
        for dp in ([dp_llm] if is_llm else divisors(dp_llm)):
            lo, hi = 0, len(valid)  # memory falls as PP grows: bisect the fewest stages
            while lo < hi:
                mid = (lo + hi) // 2
                if memory_bytes(cost, Choice(tp, dp, valid[mid]), dp_llm, m) <= hw.hbm_bytes:
                    hi = mid
                else:
                    lo = mid + 1
            if lo < len(valid):
                ch = Choice(tp, dp, valid[lo])
                key = (ch.gpus, stage_time(cost, ch, dp_llm))
                if best is None or key < best[0]:
                    best = (key, ch)
    return None if best is None else best[1]


def smallest_plan(costs, hw: Hardware, bs: int) -> tuple[int, dict[str, Choice]] | None:
    """(GPUs, choices) of the plan with the fewest GPUs that fits in memory (any LLM DP
    dividing the global batch; the fastest of equals), or None when some unit fits nowhere.
    Units only share the GPU budget, so the fewest per unit add up to the fewest in all."""
    best = None
    for dp_llm in divisors(bs):
        m = bs // dp_llm
        chs = {c.name: _fewest_gpus_choice(c, hw, dp_llm, m, is_llm(c.name)) for c in costs}
        if any(ch is None for ch in chs.values()):
            continue
        g = sum(ch.gpus for ch in chs.values())
        if best is None or g < best[0]:
            best = (g, chs)
        elif g == best[0]:
            if (evaluate(costs, chs, bs, hw).iteration_time_s
                    < evaluate(costs, best[1], bs, hw).iteration_time_s):
                best = (g, chs)
    return best


def _describe(choices: dict[str, Choice]) -> str:
    return "; ".join(f"{k} tp={c.tp} dp={c.dp} pp={c.pp}" for k, c in choices.items())


def infeasible_message(costs, hw: Hardware, n: int, bs: int) -> str:
    """Say what is short and by how much: memory per GPU (a unit that fits on no
    parallelisation), or the GPU count (the smallest plan that also fits in memory)."""
    have = hw.hbm_bytes / 1e9
    sp = smallest_plan(costs, hw, bs)
    if sp is None:
        for c in costs:
            t, pp = max(c.time_s), valid_pps(c)[-1]
            # least memory: most TP and stages, one sample per rank, DP for ZeRO-1
            mem = min(memory_bytes(c, Choice(t, d, pp), d, bs // d) for d in divisors(bs)) / 1e9
            if mem > have:
                return (f"unit {c.name!r} needs {mem:.1f} GB per GPU even at tp={t}, pp={pp}; "
                        f"have {have:.0f} GB: {mem - have:.1f} GB short per GPU: use "
                        f"activation recomputation or GPUs with more memory")
        return (f"no LLM DP dividing global_batch={bs} fits every unit in {have:.0f} GB per "
                f"GPU: change the global batch, use activation recomputation or GPUs with "
                f"more memory")
    g, chs = sp
    if g <= n:
        return (f"nothing is short: the smallest plan that fits in memory needs {g} of the "
                f"{n} GPUs ({_describe(chs)})")
    msg = (f"too few GPUs: the smallest plan that fits in memory needs {g} GPUs "
           f"({_describe(chs)}); have {n}: add {g - n} GPU{'s' if g - n > 1 else ''}")
    llm = next(c for c in costs if is_llm(c.name))
    tp = max(llm.time_s)
    others = sum(ch.gpus for k, ch in chs.items() if not is_llm(k))
    pps = [p for p in valid_pps(llm) if tp * p + others <= n]
    if pps:  # why fewer do not do: the LLM at the most stages the GPUs leave it
        mem = memory_bytes(llm, Choice(tp, 1, pps[-1]), 1, bs) / 1e9
        if mem > have:
            msg += (f" (with {n} GPUs the LLM gets at most pp={pps[-1]} at tp={tp} and needs "
                    f"{mem:.1f} GB per GPU; have {have:.0f} GB)")
    return msg
