"""DistTrain reordering (DistTrain §6): Algorithm 2 vs exhaustive partitions, the pipeline
recurrence vs closed forms / a hand table / the general simulator, Algorithm 3 vs all orders."""

import itertools
import math

import numpy as np
import pytest

from mmjax.data.reorder import (PipelineModel, exhaustive_best_order, inter_reorder,
                                intra_reorder, pipeline_time)


def _opt_makespan(x, m):
    """Exact multiway partition optimum by enumerating all m^n assignments."""
    x = np.asarray(x, dtype=float)
    assign = np.array(list(itertools.product(range(m), repeat=len(x))))
    loads = np.stack([((assign == b) * x).sum(axis=1) for b in range(m)], axis=1)
    return loads.max(axis=1).min()


def _fb(costs, ratio=2.0):
    return [float(c) for c in costs], [ratio * float(c) for c in costs]


# ------------------------------------------------------------------ Algorithm 2


def test_intra_reorder_within_lpt_bound_of_exhaustive_optimum():
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(40):
        n = int(rng.integers(3, 10))
        m = int(rng.integers(2, 4))
        sizes = rng.integers(1, 50, n).tolist()
        groups = intra_reorder(sizes, m)
        assert len(groups) == m
        assert sorted(i for g in groups for i in g) == list(range(n))
        got = max(sum(sizes[i] for i in g) for g in groups)
        opt = _opt_makespan(sizes, m)
        worst = max(worst, got / opt)
        assert got <= (4 / 3 - 1 / (3 * m)) * opt + 1e-9, (sizes, m, got, opt)
    assert worst >= 1.0


def test_intra_reorder_descending_beats_papers_ascending_counterexample():
    # Ascending greedy gives {1, 2}, {1} -> 3; the optimum (and LPT) is 2.
    groups = intra_reorder([1, 1, 2], 2)
    assert max(sum([1, 1, 2][i] for i in g) for g in groups) == 2


def test_intra_reorder_deterministic_and_validates():
    sizes = np.random.default_rng(3).integers(1, 9, 50).tolist()  # many ties
    assert intra_reorder(sizes, 4) == intra_reorder(list(sizes), 4)
    with pytest.raises(ValueError, match="num_groups"):
        intra_reorder([1, 2], 0)
    with pytest.raises(ValueError, match="sizes"):
        intra_reorder([1, -2], 2)


# ------------------------------------------------------------------ the recurrence


@pytest.mark.parametrize("p,l", [(1, 3), (2, 2), (4, 6), (4, 3), (8, 8)])
def test_homogeneous_1f1b_closed_form(p, l):
    # (l + p - 1) (f + b) with f = 1, b = 2.
    assert pipeline_time([1.0] * l, p) == pytest.approx((l + p - 1) * 3.0)


@pytest.mark.parametrize("p,l,v", [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 2)])
def test_homogeneous_interleaved_closed_form(p, l, v):
    # Megatron interleaved 1F1B bubble: (p - 1) (f + b) / v on top of l (f + b).
    assert pipeline_time([1.0] * l, p, num_chunks=v) == pytest.approx(l * 3.0 + (p - 1) * 3.0 / v)


def test_recurrence_hand_table():
    # p = 2, f = [1, 2], b = [2, 4]. Stage 0: F0 0-1, F1 1-3, B0 4-6, B1 10-14.
    # Stage 1: F0 1-2, B0 2-4, F1 4-6, B1 6-10.
    model = PipelineModel.build(2, 2)
    start, end = model.times([1, 2], [2, 4])
    got = {a: (s, e) for a, s, e in zip(model.actions, start, end)}
    assert got == {("F", 0, 0, 0): (0, 1), ("F", 1, 0, 0): (1, 2), ("B", 1, 0, 0): (2, 4),
                   ("F", 0, 1, 0): (1, 3), ("F", 1, 1, 0): (4, 6), ("B", 0, 0, 0): (4, 6),
                   ("B", 1, 1, 0): (6, 10), ("B", 0, 1, 0): (10, 14)}
    assert pipeline_time([(1, 2), (2, 4)], 2) == 14


def test_lower_and_upper_bounds_hold_for_every_order():
    """LB = sum(f+b) + (p-1)(f_min+b_min): the last stage does all its work, after the first
    forward reaches it and before the last backward leaves. UB = p * sum(f+b): at any time
    before the end some action runs (the earliest unfinished one in topological order)."""
    rng = np.random.default_rng(1)
    for _ in range(10):
        p, l = int(rng.integers(2, 5)), int(rng.integers(2, 6))
        f, b = _fb(rng.lognormal(0, 1, l))
        model = PipelineModel.build(p, l)
        s = sum(f) + sum(b)
        for perm in itertools.permutations(range(l)):
            t = model.iteration_time([f[j] for j in perm], [b[j] for j in perm])
            assert s + (p - 1) * (min(f) + min(b)) - 1e-9 <= t <= p * s + 1e-9


def test_agrees_with_general_simulator_on_1f1b_and_interleaved():
    schedule = pytest.importorskip("mmjax.schedule.schedule")
    simulate = pytest.importorskip("mmjax.schedule.simulate")
    rng = np.random.default_rng(2)
    for p, l, v in [(2, 5, 1), (4, 7, 1), (3, 3, 1), (2, 4, 2), (4, 8, 2), (3, 6, 3), (2, 2, 2)]:
        costs = rng.uniform(0.5, 5.0, (l, 2)).tolist()
        order = rng.permutation(l).tolist()
        table = (schedule.one_f_one_b(p, l) if v == 1
                 else schedule.interleaved_one_f_one_b(p, l, v))

        def cost(stage, action, costs=costs, order=order, v=v):
            f, b = costs[order[action.microbatch]]
            return (f if action.kind == "F" else b) / v

        ref = simulate.simulate(table, cost).iteration_time
        assert pipeline_time(costs, p, order, num_chunks=v) == pytest.approx(ref, rel=1e-12)


def test_stage_costs_agree_with_general_simulator():
    schedule = pytest.importorskip("mmjax.schedule.schedule")
    simulate = pytest.importorskip("mmjax.schedule.simulate")
    rng = np.random.default_rng(3)
    for p, l, v in [(4, 6, 1), (3, 6, 2)]:
        costs = rng.uniform(0.5, 5.0, l).tolist()
        stage_costs = [tuple(rng.uniform(0, 2, 3)) for _ in range(p)]
        order = rng.permutation(l).tolist()
        table = (schedule.one_f_one_b(p, l) if v == 1
                 else schedule.interleaved_one_f_one_b(p, l, v))

        def cost(stage, action, costs=costs, order=order, sc=stage_costs, v=v):
            scale, fo, bo = sc[stage]
            f = costs[order[action.microbatch]]
            return (scale * f + fo if action.kind == "F" else scale * 2 * f + bo) / v

        ref = simulate.simulate(table, cost).iteration_time
        got = pipeline_time(costs, p, order, num_chunks=v, stage_costs=stage_costs)
        assert got == pytest.approx(ref, rel=1e-12)


def test_recurrence_validates():
    with pytest.raises(ValueError, match="multiple of num_stages"):
        pipeline_time([1.0] * 5, 2, num_chunks=2)
    with pytest.raises(ValueError, match="permutation"):
        pipeline_time([1.0] * 3, 2, order=[0, 0, 1])
    with pytest.raises(ValueError, match=r"costs\[1\]"):
        pipeline_time([1.0, (1, 2, 3)], 2)
    with pytest.raises(ValueError, match="num_stages"):
        pipeline_time([1.0], 0)
    with pytest.raises(ValueError, match=r"stage_costs\[1\]"):
        pipeline_time([1.0], 2, stage_costs=[(1, 0, 0), (1, -1, 0)])
    with pytest.raises(ValueError, match="one entry per stage"):
        pipeline_time([1.0], 2, stage_costs=[(1, 0, 0)])


# ------------------------------------------------------------------ Algorithm 3


def _paper_stages(p, costs, generator):
    """DistTrain §6.2's pipeline: encoder stage 0 (time ~ size), LLM stages with a fixed time
    (the mean encoder time: orchestration balances the units), optionally a generator last."""
    m = float(np.mean(costs))
    llm = (0.0, m, 2 * m)
    return [(1.0, 0.0, 0.0)] + [llm] * (p - 2) + [(1.0, 0.0, 0.0) if generator else llm]


def _ratios(p, v, trials, l_range, seed, model_kind="uniform"):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        l = int(rng.choice(l_range))
        costs = rng.lognormal(0.0, 0.8, l).tolist()
        f, b = _fb(costs)
        sc = (None if model_kind == "uniform"
              else _paper_stages(p, costs, model_kind == "enc_llm_gen"))
        model = PipelineModel.build(p, l, v, sc)
        times = [model.iteration_time([f[j] for j in perm], [b[j] for j in perm])
                 for perm in itertools.permutations(range(l))]
        order = inter_reorder(costs, p, num_chunks=v, stage_costs=sc)
        assert sorted(order) == list(range(l))
        assert order == inter_reorder(list(costs), p, num_chunks=v, stage_costs=sc)
        got = pipeline_time(costs, p, order, num_chunks=v, stage_costs=sc)
        plain = pipeline_time(costs, p, inter_reorder(costs, p, num_chunks=v, guard=False,
                                                      stage_costs=sc), num_chunks=v, stage_costs=sc)
        opt = min(times)
        if sc is None:
            s = sum(f) + sum(b)
            # Provable: opt >= LB and got <= p * sum(f + b) (see the bounds test).
            assert got / opt <= p * s / (s + (p - 1) * (min(f) + min(b))) + 1e-9
        assert got <= plain + 1e-9
        out.append((got / opt, float(np.mean(times)) / opt, plain / opt))
    return np.array(out)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_inter_reorder_vs_exhaustive_1f1b(p):
    r = _ratios(p, 1, trials=14, l_range=range(p + 1, 8), seed=10 + p)
    print(f"p={p}: inter_reorder/opt max {r[:, 0].max():.3f} mean {r[:, 0].mean():.3f} "
          f"(unguarded Alg. 3: max {r[:, 2].max():.3f} mean {r[:, 2].mean():.3f}); "
          f"random/opt mean {r[:, 1].mean():.3f}")
    # Empirical regression guard on these fixed seeds (the best provable bound is the
    # per-instance one asserted in _ratios): never worse than 15% over the optimum...
    assert r[:, 2].max() <= 1.15
    # ...and better than a random order on average (Algorithm 3 alone, and guarded).
    assert r[:, 2].mean() < r[:, 1].mean()
    assert r[:, 0].mean() <= r[:, 2].mean()


@pytest.mark.parametrize("kind", ["enc_llm", "enc_llm_gen"])
def test_inter_reorder_vs_exhaustive_paper_pipeline(kind):
    """Encoder stage + fixed-time LLM stages (+ generator), the setting of DistTrain §6.2."""
    r = np.concatenate([_ratios(p, 1, trials=5, l_range=range(p + 1, 8), seed=20 + p,
                                model_kind=kind) for p in (2, 3, 4)])
    print(f"{kind}: inter_reorder/opt max {r[:, 0].max():.3f} mean {r[:, 0].mean():.3f} "
          f"(unguarded Alg. 3: max {r[:, 2].max():.3f} mean {r[:, 2].mean():.3f}); "
          f"random/opt mean {r[:, 1].mean():.3f}")
    assert r[:, 2].max() <= 1.15
    assert r[:, 2].mean() < r[:, 1].mean()
    assert r[:, 0].mean() <= r[:, 2].mean()


def test_inter_reorder_vs_exhaustive_interleaved():
    r = _ratios(2, 2, trials=8, l_range=[4, 6], seed=7)
    r = np.concatenate([r, _ratios(3, 2, trials=3, l_range=[6], seed=8)])
    print(f"VPP v=2: inter_reorder/opt max {r[:, 0].max():.3f} mean {r[:, 0].mean():.3f} "
          f"(unguarded Alg. 3: max {r[:, 2].max():.3f} mean {r[:, 2].mean():.3f}); "
          f"random/opt mean {r[:, 1].mean():.3f}")
    assert r[:, 2].max() <= 1.15
    assert r[:, 2].mean() < r[:, 1].mean()
    assert r[:, 0].mean() <= r[:, 2].mean()


def test_inter_reorder_structure():
    costs = [5.0, 1.0, 9.0, 2.0, 7.0, 3.0, 8.0, 0.5]
    order = inter_reorder(costs, 4, guard=False)
    assert order[0] == 7  # smallest first
    assert sorted(order[-3:]) == [1, 3, 5]  # the p - 1 next smallest last
    assert order[-3:] == [5, 3, 1]  # largest of them first
    assert inter_reorder([], 4) == []
    assert inter_reorder([3.0], 4) == [0]
    assert sorted(inter_reorder(np.random.default_rng(0).random(40).tolist(), 8)) == list(range(40))


def test_guard_never_slower_than_given_or_ascending_order():
    rng = np.random.default_rng(12)
    for l, p, v in [(32, 4, 1), (64, 8, 1), (32, 4, 2), (9, 3, 1)]:
        costs = rng.lognormal(0, 0.8, l).tolist()
        got = pipeline_time(costs, p, inter_reorder(costs, p, v), v)
        plain = pipeline_time(costs, p, inter_reorder(costs, p, v, guard=False), v)
        asc = pipeline_time(costs, p, sorted(range(l), key=costs.__getitem__), v)
        assert got <= min(plain, asc, pipeline_time(costs, p, None, v)) + 1e-9


def test_exhaustive_best_order_is_minimal():
    costs = [3.0, 1.0, 4.0, 1.5, 2.0]
    order, t = exhaustive_best_order(costs, 3)
    assert t == pytest.approx(pipeline_time(costs, 3, order))
    assert all(pipeline_time(costs, 3, perm) >= t - 1e-12
               for perm in itertools.permutations(range(5)))
    with pytest.raises(ValueError, match="l <= 8"):
        exhaustive_best_order([1.0] * 9, 2)
    assert math.isfinite(t)
