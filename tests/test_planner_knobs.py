"""The planner's per-unit knobs: remat (least recompute that fits), context parallelism for
long sequences and overlapped TP, and the time the recomputation costs (no JAX)."""
import dataclasses

import pytest

from mmjax.models.named import named_config
from mmjax.planner.build import plan_model
from mmjax.planner.costs import unit_cost
from mmjax.planner.evaluate import memory_bytes, remat_variant
from mmjax.planner.hardware import A800
from mmjax.planner.knobs import overlap_pays
from mmjax.planner.workload import default_workload, laion_like

GIB = 2 ** 30
MODEL = "disttrain/mllm_9b"


def _hw(gib):
    return dataclasses.replace(A800, hbm_bytes=gib * GIB)


def _fits(plan, hw):
    """Every unit's first stage fits per the memory model under the remat it was given."""
    for name, gb in plan.predicted["memory_gb"].items():
        assert gb * 1e9 <= hw.hbm_bytes, (name, gb)


def test_recompute_is_costed_full_above_dots_above_none():
    m = named_config(MODEL)
    wl = default_workload(m, 64)
    t = {p: unit_cost(m, wl, "llm", A800, p) for p in ("none", "dots", "full")}
    for tp in t["none"].time_s:
        none, dots, full = (t[p].time_s[tp] for p in ("none", "dots", "full"))
        fwd = t["none"].fwd_s[tp]
        assert none < dots < full
        assert full - none == pytest.approx(fwd, rel=1e-9)  # full re-runs the forward
        assert dots - none < 0.5 * fwd  # selective: the attention core only
    # and memory the other way round: fewer residuals kept per in-flight microbatch
    kept = {p: t[p].activation_bytes[8] + t[p].input_bytes for p in t}
    assert kept["none"] > kept["dots"] > kept["full"]


def test_roomy_memory_keeps_everything_tight_memory_recomputes():
    m = named_config(MODEL)
    roomy, tight = _hw(160), _hw(24)
    a = plan_model(m, roomy, 98, 128)
    b = plan_model(m, tight, 98, 128)
    assert {u.remat for u in a.units} == {"none"}
    assert b.unit("llm").remat in ("dots", "full")
    _fits(a, roomy)
    _fits(b, tight)
    assert b.predicted["iteration_time_s"] > a.predicted["iteration_time_s"]


def test_remat_is_the_least_recompute_that_fits():
    """Per choice: "none" when it fits, else "dots", else "full" (the fastest that fits)."""
    from mmjax.planner.build import model_costs
    from mmjax.planner.evaluate import Choice

    m = named_config(MODEL)
    hw = _hw(60)
    costs, _ = model_costs(m, hw)
    llm = next(c for c in costs if c.name == "llm")
    seen = set()
    for pp in (1, 2, 4, 8, 16, 32):
        ch = Choice(1, 4, pp)
        v = remat_variant(llm, ch, 4, 32, hw.hbm_bytes)
        need = {p: memory_bytes(c, dataclasses.replace(ch, remat=p), 4, 32)
                for p, c in llm.variants.items()}
        fitting = [p for p in ("none", "dots", "full") if need[p] <= hw.hbm_bytes]
        assert v.remat == (fitting[0] if fitting else min(need, key=need.get))
        seen.add(v.remat)
    assert seen == {"none", "dots", "full"}  # more stages: less kept per GPU


def test_long_sequences_get_context_parallelism():
    m = named_config(MODEL)
    short = plan_model(m, A800, 98, 64, workload=laion_like(m, 128, 0, seq_len=8192))
    long = plan_model(m, A800, 98, 64, workload=laion_like(m, 128, 0, seq_len=131072))
    assert short.unit("llm").cp == 1
    assert long.unit("llm").cp > 1 and not long.unit("llm").overlap_tp
    _fits(long, A800)
    long.validate(m, 98)


def test_overlapped_tp_when_it_hides_the_collectives():
    m = named_config(MODEL)
    wl = default_workload(m, 64)
    assert not overlap_pays(m, wl, 1, A800)
    assert overlap_pays(m, wl, 8, A800)  # 8-way all-reduces of 4096-wide activations
    plan = plan_model(m, _hw(40), 98, 128)
    llm = plan.unit("llm")
    assert llm.overlap_tp == (llm.tp > 1 and overlap_pays(m, default_workload(m), llm.tp,
                                                          A800))


def test_bounds_price_the_llm_at_its_remat_and_match_the_scalar_bounds():
    """The fast candidate bounds (numpy) equal the scalar ones of the cvxpy path with remat
    variants, and never exceed the plan found (they are lower bounds)."""
    import numpy as np

    from mmjax.planner.build import model_costs
    from mmjax.planner.orchestrate import Orchestrator

    m = named_config(MODEL)
    costs, _ = model_costs(m, A800)
    fast = Orchestrator(costs, A800).candidates(98, 128)
    ref = Orchestrator(costs, A800, method="cvxpy").candidates(98, 128)
    assert [(d, t) for _, d, t, _ in fast] == [(d, t) for _, d, t, _ in ref]
    np.testing.assert_allclose([b for b, *_ in fast], [b for b, *_ in ref], rtol=1e-12)
    best = Orchestrator(costs, A800).solve(98, 128).optimal_time_s
    assert fast[0][0] <= best * (1 + 1e-12)
