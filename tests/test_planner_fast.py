"""The planner's fast path (DistTrain §5.2, Algorithm 1: numpy candidate bounds, closed-form
relaxations, vectorised repair) against the formulation of record (cvxpy) and against the
plans recorded before it existed (tests/data/planner_plans.json, scripts/record_plans.py)."""
import json
import os
import sys

import numpy as np
import pytest

from mmjax.planner.orchestrate import Orchestrator, orchestrate
from mmjax.planner.relaxed_problem import RelaxedProblem
from mmjax.planner.relax import solve_relaxed

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.dirname(__file__))

from record_plans import TOLERANCES, record, setting_key  # noqa: E402
from test_planner_orchestrate import HW, random_problem  # noqa: E402


def _fixture():
    with open(os.path.join(os.path.dirname(__file__), "data", "planner_plans.json")) as f:
        return json.load(f)


def test_same_plans_as_recorded_on_every_named_setting():
    """Every setting of bench_planner (DistTrain Table 2 / §8.2 / §8.3.1, OrchMLLM, every
    Cornstarch config) at both tolerances: the same plan and time as before."""
    want, got = _fixture(), record()
    assert set(got) == set(want) and len(want) == 56
    for key in want:
        assert got[key]["plan"] == want[key]["plan"], key
        assert got[key]["iteration_time_s"] == pytest.approx(want[key]["iteration_time_s"],
                                                             rel=1e-12), key
        assert got[key]["optimal_time_s"] == pytest.approx(want[key]["optimal_time_s"],
                                                           rel=1e-12), key


@pytest.mark.parametrize("name,gpus,batch", [("cornstarch/vlm_s", 24, 24),
                                             ("disttrain/mllm_9b", 98, 128)])
def test_cvxpy_method_gives_the_recorded_plan(name, gpus, batch):
    from mmjax.models.named import named_config
    from mmjax.planner.build import model_costs
    from mmjax.planner.hardware import A800

    costs, _ = model_costs(named_config(name), A800)
    want = _fixture()
    for tol in TOLERANCES:
        res = orchestrate(costs, A800, gpus, batch, gpu_tolerance=tol, method="cvxpy")
        plan = {k: [v.tp, v.dp, v.pp, v.vpp, v.remat] for k, v in res.choices.items()}
        assert plan == want[setting_key(name, gpus, batch, None, tol)]["plan"]


@pytest.mark.parametrize("seed", range(10))
def test_vectorised_candidates_equal_the_scalar_ones(seed):
    costs, n, bs = random_problem(seed)
    fast = Orchestrator(costs, HW).candidates(n, bs)
    ref = Orchestrator(costs, HW, method="cvxpy").candidates(n, bs)
    assert [(d, t) for _, d, t, _ in fast] == [(d, t) for _, d, t, _ in ref]
    for (b1, _, _, in1), (b2, _, _, in2) in zip(fast, ref):
        assert b1 == pytest.approx(b2, rel=1e-12)
        for a, b in zip(in1, in2):
            np.testing.assert_allclose(a, b, rtol=1e-12)


def test_share_bound_is_the_smallest_feasible_tau():
    """Against bisection on sum_u max(lo_u, c_u / tau) <= room, including the degenerate
    room == sum(lo) (the answer is then max c / lo, not the hi floor)."""
    from mmjax.planner.candidates import share_bound

    rng = np.random.default_rng(3)
    for trial in range(60):
        k = int(rng.integers(1, 4))
        c, lo = rng.uniform(0.1, 10, k), rng.uniform(0.5, 8, k)
        hi = lo + rng.uniform(1, 100, k)
        room = lo.sum() if trial % 5 == 0 else lo.sum() + rng.uniform(0, 40)
        got = float(share_bound(c, lo, hi, np.float64(room)))
        a, b = np.max(c / hi), 1e6
        for _ in range(200):
            mid = 0.5 * (a + b)
            a, b = (a, mid) if np.maximum(lo, c / mid).sum() <= room else (mid, b)
        assert got == pytest.approx(b, rel=1e-9)
    assert share_bound(np.ones(2), np.ones(2), np.ones(2) * 9, np.float64(1.5)) == np.inf


def _objective(x, c, e, slope, w, wc, mm):
    return (mm * np.max(c / x) + np.max(e / x) + slope @ x
            + np.sum(np.maximum(w, wc / x)))


def test_closed_form_relaxation_matches_cvxpy_on_random_instances():
    """Optimum within cvxpy's tolerance; its x is feasible and as good as Clarabel's up to
    the interior point's tolerance (the closed form is exact)."""
    rng = np.random.default_rng(5)
    prob = RelaxedProblem(3)
    checked = 0
    for _ in range(40):
        k = 3
        c = rng.uniform(0.1, 50, k)
        e = np.zeros(k)
        e[1] = rng.uniform(0, 20) * (rng.random() < 0.7)
        slope = rng.uniform(1e-6, 1e-2, k)
        lo = rng.uniform(0.5, 20, k)
        hi = lo + rng.uniform(1, 500, k)
        n = float(lo.sum() + rng.uniform(0, 300))
        mm = float(rng.integers(0, 60))
        w = np.where(np.arange(k) == 1, 0.0, c / rng.uniform(1, 64, k))
        wc = np.where(np.arange(k) == 1, 0.0, c)
        value, x, ok = solve_relaxed(c, e, slope, lo, hi, n, mm, w, wc)
        ref = prob.solve(c, e, slope, lo, hi, n, mm, w, wc)
        if ref is None or not np.isfinite(ref[0]):  # solver failure / inaccurate
            continue
        checked += 1
        assert ok[0]
        assert value[0] == pytest.approx(ref[0], rel=2e-5, abs=1e-9)
        assert np.all(x[0] >= lo - 1e-9) and np.all(x[0] <= hi + 1e-9)
        assert x[0].sum() <= n * (1 + 1e-12)
        mine = _objective(x[0], c, e, slope, w, wc, mm)
        assert mine == pytest.approx(value[0], rel=1e-12)
        # Clarabel's x may violate sum x <= n by ~1e-8 (its feasibility tolerance)
        assert mine <= _objective(ref[1], c, e, slope, w, wc, mm) * (1 + 1e-7)
    assert checked >= 30


def test_closed_form_known_case_and_infeasible_rows():
    """c_u / x_u = tau for all u, sum x = N (the binding case of the cvxpy test), batched
    with an infeasible row (sum lo > N)."""
    c = np.array([[1.0, 4.0, 9.0], [1.0, 1.0, 1.0]])
    z = np.zeros((2, 3))
    lo = np.array([[0.1] * 3, [10.0] * 3])
    value, x, ok = solve_relaxed(c, z, z, lo, np.full((2, 3), 1e6), 14.0, 10.0, z, z)
    tau = 14.0 / 14.0
    assert ok.tolist() == [True, False] and value[1] == np.inf
    assert value[0] == pytest.approx(10 * tau, rel=1e-12)
    np.testing.assert_allclose(x[0], c[0] / tau, rtol=1e-12)
    with pytest.raises(ValueError, match="at most one unit"):
        solve_relaxed(c[:1], np.ones((1, 3)), z[:1], lo[:1], np.full((1, 3), 9.0), 30.0,
                      1.0, z[:1], z[:1])


def test_method_is_validated():
    costs, n, bs = random_problem(0)
    with pytest.raises(ValueError, match="method='simplex'"):
        orchestrate(costs, HW, n, bs, method="simplex")


def test_a_unit_with_no_work_plans_like_cvxpy():
    """A generator with nothing to generate in the data (time 0, c_u = 0): the closed
    form must not drop every candidate (it once did: the smallest plan came back)."""
    import dataclasses
    import warnings

    costs, n, bs = random_problem(1)
    idle = dataclasses.replace(costs[0], time_s={t: 0.0 for t in costs[0].time_s},
                               fwd_s={})
    costs = (idle,) + costs[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the "found no plan" fallback warns
        fast = orchestrate(costs, HW, n, bs)
    ref = orchestrate(costs, HW, n, bs, method="cvxpy")
    assert fast.choices == ref.choices
    assert fast.iteration_time_s == pytest.approx(ref.iteration_time_s, rel=1e-12)
