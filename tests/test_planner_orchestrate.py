"""Orchestrator (seed 000 §5.2, Algorithm 1) against exhaustive integer search."""
import itertools
import math

import numpy as np
import pytest

from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, choice_error, evaluate, stage_time, sync_time,
                                    warmup_time)
from mmjax.planner.hardware import Hardware
from mmjax.planner.orchestrate import RelaxedProblem, divisors, orchestrate
from mmjax.planner.plan import PlanError

HW = Hardware("test", peak_flops=1e14, hbm_bytes=40e9, nvlink_bw=2e11, nic_bw=2.5e10)


def random_unit(rng, name, layers, scale, pp_divides=False):
    base = scale * rng.uniform(0.5, 2.0)
    tps = sorted(rng.choice([1, 2, 4, 8], size=rng.integers(2, 5), replace=False).tolist())
    if 1 not in tps:
        tps = [1] + tps
    exp = rng.uniform(0.5, 1.0)
    comm = rng.uniform(0.0, 0.05) * base
    time_s = {t: base / t ** exp + (comm * math.log2(t) if t > 1 else 0.0) for t in tps}
    act = rng.uniform(1e9, 30e9)
    return UnitCost(name=name, num_layers=layers, time_s=time_s,
                    weight_bytes=rng.uniform(1e9, 80e9), optimizer_bytes=rng.uniform(0, 160e9),
                    activation_bytes={t: act / t for t in tps},
                    boundary_bytes=rng.uniform(1e6, 1e8), grad_bytes=rng.uniform(0, 50e9),
                    flops=1e12, layer_pp_divides=pp_divides)


def random_problem(seed):
    rng = np.random.default_rng(seed)
    units = []
    n_enc = int(rng.integers(1, 3))
    for k in range(n_enc):
        units.append(random_unit(rng, f"enc{k}", int(rng.integers(1, 5)), rng.uniform(0.05, 1.0)))
    units.append(random_unit(rng, "llm", int(rng.choice([4, 6, 8])), 4.0, pp_divides=True))
    if rng.random() < 0.5:
        units.append(random_unit(rng, "generator", int(rng.integers(1, 4)), rng.uniform(0.05, 1.0)))
    n = int(rng.integers(4, 65))
    bs = int(rng.choice([4, 6, 8, 12, 16]))
    return tuple(units), n, bs


def exhaustive(costs, n, bs, vpp=True):
    """Every integer plan: TP per unit, LLM DP | BS, unit DP | LLM DP, any valid PP/VPP."""
    best = math.inf
    names = [c.name for c in costs]
    for dp_llm in divisors(bs):
        m = bs // dp_llm
        per_unit = []
        for c in costs:
            opts = []
            for tp in c.time_s:
                for dp in ([dp_llm] if c.name == "llm" else divisors(dp_llm)):
                    for pp in range(1, c.num_layers + 1):
                        for v in ((1, 2) if vpp and c.name == "llm" else (1,)):
                            ch = Choice(tp, dp, pp, v)
                            if ch.gpus <= n and choice_error(c, ch, dp_llm, m, HW) is None:
                                opts.append((ch.gpus, stage_time(c, ch, dp_llm),
                                             warmup_time(c, ch, dp_llm, HW), sync_time(c, ch, HW)))
            per_unit.append(np.array(opts).reshape(-1, 4))
        if any(len(o) == 0 for o in per_unit):
            continue
        for combo in itertools.product(*[range(len(o)) for o in per_unit]):
            rows = [per_unit[u][j] for u, j in enumerate(combo)]
            if sum(r[0] for r in rows) > n:
                continue
            t = (sum(r[2] for r in rows) + (m - 1) * max(r[1] for r in rows)
                 + max(r[3] for r in rows))
            best = min(best, t)
    return best


@pytest.mark.parametrize("seed", range(16))
def test_matches_exhaustive_search(seed):
    costs, n, bs = random_problem(seed)
    want = exhaustive(costs, n, bs)
    if not math.isfinite(want):
        with pytest.raises(PlanError):
            orchestrate(costs, HW, n, bs)
        return
    res = orchestrate(costs, HW, n, bs)
    assert res.iteration_time_s == pytest.approx(want, rel=1e-9), (seed, res.choices)
    ev = evaluate(costs, res.choices, bs, HW)
    assert ev.iteration_time_s == pytest.approx(res.iteration_time_s, rel=1e-12)
    assert ev.gpus <= n
    dp_llm = res.choices["llm"].dp
    for c in costs:
        assert choice_error(c, res.choices[c.name], dp_llm, bs // dp_llm, HW) is None


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16, 60))
def test_matches_exhaustive_search_more(seed):
    test_matches_exhaustive_search(seed)


def test_relaxation_is_a_lower_bound_and_dpp():
    """Re-solving the parameterised problem gives the closed-form optimum of a case with
    one binding resource constraint: c_u / x_u = tau for all u, sum x = N."""
    prob = RelaxedProblem(3)
    c = np.array([1.0, 4.0, 9.0])
    z = np.zeros(3)
    value, x = prob.solve(c, z, z, np.full(3, 0.1), np.full(3, 1e6), 14.0, 10.0)
    tau = c.sum() / 14.0
    assert value == pytest.approx(10 * tau, rel=1e-5)
    assert x == pytest.approx(c / tau, rel=1e-4)
    value2, _ = prob.solve(c, z, z, np.full(3, 0.1), np.full(3, 1e6), 28.0, 10.0)
    assert value2 == pytest.approx(value / 2, rel=1e-5)


def test_too_few_gpus_message_says_how_many():
    costs, _, _ = random_problem(3)
    with pytest.raises(PlanError, match="GPU"):
        orchestrate(costs, HW, 1, 8)


def exhaustive_vectorized(costs, hw, n, bs):
    """All integer plans of a paper-scale setting, combined with numpy broadcasting."""
    best = math.inf
    for dp_llm in divisors(bs):
        m = bs // dp_llm
        per = []
        for c in costs:
            rows = []
            for tp in c.time_s:
                for dp in ([dp_llm] if c.name == "llm" else divisors(dp_llm)):
                    for pp in range(1, c.num_layers + 1):
                        for v in ((1, 2) if c.name == "llm" else (1,)):
                            ch = Choice(tp, dp, pp, v)
                            if ch.gpus <= n and choice_error(c, ch, dp_llm, m, hw) is None:
                                rows.append((ch.gpus, stage_time(c, ch, dp_llm),
                                             warmup_time(c, ch, dp_llm, hw), sync_time(c, ch, hw)))
            per.append(np.array(rows).reshape(-1, 4))
        if any(len(p) == 0 for p in per):
            continue
        g, st, w, sy = 0.0, 0.0, 0.0, 0.0
        for ax, a in enumerate(per):
            view = [1] * len(per)
            view[ax] = len(a)
            g = g + a[:, 0].reshape(view)
            st = np.maximum(st, a[:, 1].reshape(view))
            w = w + a[:, 2].reshape(view)
            sy = np.maximum(sy, a[:, 3].reshape(view))
        best = min(best, float(np.where(g <= n, w + (m - 1) * st + sy, np.inf).min()))
    return best


@pytest.mark.parametrize("name,gpus,batch", [("disttrain/mllm_72b", 324, 480),
                                             ("disttrain/mllm_9b", 98, 128),
                                             ("orchmllm/mllm_10b", 128, 512),
                                             ("cornstarch/valm_ll", 24, 24)])
def test_paper_scale_matches_exhaustive_search(name, gpus, batch):
    from mmjax.models.named import named_config
    from mmjax.planner.hardware import A800, H100
    from mmjax.planner.build import model_costs

    hw = H100 if name.startswith("orchmllm") else A800
    costs, _ = model_costs(named_config(name), hw)
    res = orchestrate(costs, hw, gpus, batch)
    assert res.iteration_time_s == pytest.approx(exhaustive_vectorized(costs, hw, gpus, batch),
                                                 rel=1e-9)
