"""Orchestrator (DistTrain §5.2, Algorithm 1) against exhaustive integer search."""
import itertools
import math

import numpy as np
import pytest

from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, choice_error, evaluate, remat_variant, stage_time,
                                    sync_time, warmup_time)
from mmjax.planner.hardware import Hardware
from mmjax.planner.orchestrate import GPU_TOLERANCE, Orchestrator, divisors, orchestrate
from mmjax.planner.relaxed_problem import RelaxedProblem
from mmjax.planner.infeasible import smallest_plan
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


def unit_rows(c, hw, tps, dp_llm, m, n, vpp=True):
    """Every valid integer choice of unit c at the given TP sizes (m microbatches):
    rows of (gpus, stage, warm, sync)."""
    rows = []
    for tp in tps:
        for dp in ([dp_llm] if c.name == "llm" else divisors(dp_llm)):
            for pp in range(1, c.num_layers + 1):
                for v in ((1, 2) if vpp and c.name == "llm" else (1,)):
                    ch = Choice(tp, dp, pp, v)
                    if ch.gpus <= n and choice_error(c, ch, dp_llm, m, hw) is None:
                        # the remat policy this choice runs: the least recompute that fits
                        rc = remat_variant(c, ch, dp_llm, m, hw.hbm_bytes)
                        rows.append((ch.gpus, stage_time(rc, ch, dp_llm),
                                     warmup_time(rc, ch, dp_llm, hw), sync_time(rc, ch, hw)))
    return np.array(rows).reshape(-1, 4)


def plan_grid(costs, hw, n, bs, per_tp=False, vpp=True):
    """All integer plans (TP per unit, LLM DP | BS, unit DP | LLM DP, any valid PP/VPP),
    combined with numpy broadcasting: yields (key, gpus, time) with flat arrays, one key
    per LLM DP (or per (LLM DP, TPs) candidate when `per_tp`)."""
    for dp_llm in divisors(bs):
        m = bs // dp_llm
        tp_sets = ([[(t,) for t in sorted(c.time_s)] for c in costs] if per_tp
                   else [[tuple(c.time_s)] for c in costs])
        for tps in itertools.product(*tp_sets):
            per = [unit_rows(c, hw, t, dp_llm, m, n, vpp) for c, t in zip(costs, tps)]
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
            t = w + (m - 1) * st + sy
            ok = g <= n
            key = (dp_llm, tuple(x[0] for x in tps)) if per_tp else dp_llm
            yield key, g[ok].ravel(), t[ok].ravel()


def exhaustive(costs, n, bs, hw=HW, tolerance=0.0, vpp=True):
    """(least time T*, gpus, time) of the plan the planner must pick: with tolerance eps,
    the fewest GPUs among plans within T* (1 + eps), then the fastest of those (the
    tie-break of Orchestrator.solve); (inf, 0, inf) when nothing fits."""
    frontier = {}  # gpus -> least time
    for _, g, t in plan_grid(costs, hw, n, bs, vpp=vpp):
        order = np.lexsort((t, g))  # by gpus, then time: the first of each gpus is its least
        g, t = g[order], t[order]
        first = np.ones(len(g), dtype=bool)
        first[1:] = g[1:] != g[:-1]
        for gi, ti in zip(g[first], t[first]):
            frontier[int(gi)] = min(frontier.get(int(gi), math.inf), float(ti))
    if not frontier:
        return math.inf, 0, math.inf
    best = min(frontier.values())
    cap = best * (1 + tolerance)
    gpus = min(gi for gi, t in frontier.items() if t <= cap)
    return best, gpus, min(t for gi, t in frontier.items() if gi <= gpus)


def check_against_exhaustive(costs, n, bs, hw=HW, tolerance=GPU_TOLERANCE):
    best, gpus, want = exhaustive(costs, n, bs, hw, tolerance)
    if not math.isfinite(best):
        with pytest.raises(PlanError):
            orchestrate(costs, hw, n, bs, gpu_tolerance=tolerance)
        return None
    res = orchestrate(costs, hw, n, bs, gpu_tolerance=tolerance)
    assert res.optimal_time_s == pytest.approx(best, rel=1e-9), res.choices
    assert res.iteration_time_s == pytest.approx(want, rel=1e-9), res.choices
    ev = evaluate(costs, res.choices, bs, hw)
    assert ev.iteration_time_s == pytest.approx(res.iteration_time_s, rel=1e-12)
    assert ev.gpus == gpus and ev.gpus <= n
    assert res.iteration_time_s <= best * (1 + tolerance) * (1 + 1e-12)
    if tolerance == 0:
        assert res.iteration_time_s == res.optimal_time_s
    dp_llm = res.choices["llm"].dp
    for c in costs:
        assert choice_error(c, res.choices[c.name], dp_llm, bs // dp_llm, hw) is None
    return res


@pytest.mark.parametrize("seed", range(16))
def test_matches_exhaustive_search(seed):
    """Least time and the fewest-GPUs tie-break both equal exhaustive integer search."""
    costs, n, bs = random_problem(seed)
    check_against_exhaustive(costs, n, bs, tolerance=0.0)
    check_against_exhaustive(costs, n, bs)


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


@pytest.mark.parametrize("seed", [0, 1, 3, 5, 6, 7, 8, 9])  # seeds 2, 4: nothing fits
def test_bounds_hold_for_every_candidate(seed):
    """Per (LLM DP, TPs) candidate: no candidate with an integer plan is dropped, and both
    the closed-form bound and the convex relaxation are <= the candidate's best integer
    plan (exhaustive); an infeasible relaxation means no integer plan."""
    costs, n, bs = random_problem(seed)
    best = {key: float(t.min()) for key, g, t in plan_grid(costs, HW, n, bs, per_tp=True)
            if len(t)}
    orch = Orchestrator(costs, HW)
    cands = orch.candidates(n, bs)
    assert set(best) <= {(dp, tps) for _, dp, tps, _ in cands}
    finite = 0
    for lb0, dp_llm, tps, inputs in cands:
        want = best.get((dp_llm, tps), math.inf)
        assert lb0 <= want * (1 + 1e-9), (dp_llm, tps)
        sol = orch.relaxed_bound(tps, dp_llm, inputs, n)
        if sol is None:
            assert not math.isfinite(want), (dp_llm, tps)
            continue
        assert sol[0] <= want * (1 + 1e-6), (dp_llm, tps, sol[0], want)
        finite += math.isfinite(want)
    assert finite == len(best) > 0


class CountingProblem(RelaxedProblem):
    """RelaxedProblem that counts its constructions and solves."""

    built = 0

    def __init__(self, k):
        CountingProblem.built += 1
        super().__init__(k)
        self.solves = 0

    def solve(self, *args, **kwargs):
        self.solves += 1
        return super().solve(*args, **kwargs)


def test_relaxed_problem_built_once_per_call_and_resolved():
    """§5.2 / DPP: one parameterised cvxpy problem per orchestrate call, re-solved for
    every candidate the bounds do not prune (tie-break included)."""
    from mmjax.models.named import named_config
    from mmjax.planner.build import model_costs
    from mmjax.planner.hardware import A800

    costs, _ = model_costs(named_config("disttrain/mllm_9b"), A800)
    made = []

    def factory(k):
        made.append(CountingProblem(k))
        return made[-1]

    before = CountingProblem.built
    res = orchestrate(costs, A800, 98, 128, relaxed_factory=factory)
    assert CountingProblem.built - before == 1 and len(made) == 1
    assert made[0].k == len(costs)
    assert made[0].solves == res.relaxations and res.relaxations > 5
    problem = made[0].problem
    orchestrate(costs, A800, 98, 128, gpu_tolerance=0.0, relaxed_factory=factory)
    assert CountingProblem.built - before == 2 and made[0].problem is problem


def test_too_few_gpus_message_says_how_many():
    costs, _, _ = random_problem(3)
    with pytest.raises(PlanError, match="GPU"):
        orchestrate(costs, HW, 1, 8)


@pytest.mark.parametrize("seed", [0, 1, 2, 4, 5, 10])
def test_smallest_plan_is_the_threshold(seed):
    """smallest_plan's GPU count is exhaustive search's fewest; the planner fails on one
    GPU fewer, saying how many to add, and succeeds on that many."""
    costs, n, bs = random_problem(seed)
    g, chs = smallest_plan(costs, HW, bs)
    fewest = min((int(gs.min()) for _, gs, _ in plan_grid(costs, HW, max(n, g), bs)
                  if len(gs)), default=None)
    assert g == fewest
    dp_llm = chs["llm"].dp
    assert all(choice_error(c, chs[c.name], dp_llm, bs // dp_llm, HW) is None for c in costs)
    with pytest.raises(PlanError, match=f"needs {g} GPUs .*add 1 GPU"):
        orchestrate(costs, HW, g - 1, bs)
    assert evaluate(costs, orchestrate(costs, HW, g, bs).choices, bs, HW).gpus == g


def test_memory_short_message_says_by_how_much():
    costs, n, bs = random_problem(0)
    tiny = Hardware("tiny", peak_flops=1e14, hbm_bytes=2e8, nvlink_bw=2e11, nic_bw=2.5e10)
    assert smallest_plan(costs, tiny, bs) is None
    with pytest.raises(PlanError, match=r"needs [\d.]+ GB per GPU even at tp=\d+, pp=\d+; "
                                        r"have 0 GB: [\d.]+ GB short per GPU"):
        orchestrate(costs, tiny, n, bs)


class FailingProblem(RelaxedProblem):
    def solve(self, *args, **kwargs):
        return None  # as if every solve failed


def test_solver_failures_still_give_a_plan():
    """When no relaxation solves but a plan fits, the smallest plan comes back (warned)."""
    costs, n, bs = random_problem(0)
    with pytest.warns(UserWarning, match="smallest plan that fits"):
        res = orchestrate(costs, HW, n, bs, relaxed_factory=FailingProblem)
    g, chs = smallest_plan(costs, HW, bs)
    assert res.choices == chs and res.relaxations > 0
    assert res.iteration_time_s == evaluate(costs, chs, bs, HW).iteration_time_s


def test_72b_too_few_gpus_counts_memory():
    """MLLM-72B, batch 64: the LLM at tp 8 fits in 80 GB from pp 4, so the smallest plan is
    34 GPUs (8 x 4 + one per encoder/generator), not the 10 that GPU counts alone give."""
    from mmjax.models.named import named_config
    from mmjax.planner.build import model_costs
    from mmjax.planner.hardware import A800

    costs, _ = model_costs(named_config("disttrain/mllm_72b"), A800)
    for n in (4, 16, 33):
        with pytest.raises(PlanError, match=f"needs 34 GPUs .*have {n}: add {34 - n} GPU"):
            orchestrate(costs, A800, n, 64)
    assert evaluate(costs, orchestrate(costs, A800, 34, 64).choices, 64, A800).gpus == 34


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
    check_against_exhaustive(costs, gpus, batch, hw)
