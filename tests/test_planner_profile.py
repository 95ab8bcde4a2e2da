"""Profiler: the generic TP layer is exact, tables interpolate, and plug into the planner."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from mmjax.models.named import named_config
from mmjax.models.tiny import tiny_valm
from mmjax.planner.hardware import A800
from mmjax.planner.orchestrate import orchestrate
from mmjax.planner.profile import (Curve, LayerShape, ProfileTable, init_layer, layer_forward,
                                   layer_specs, profile_model, profiled_costs, sample_sizes)
from mmjax.planner.costs import unit_costs
from mmjax.planner.plan import PlanError
from mmjax.planner.workload import default_workload, orchmllm_like


@pytest.mark.parametrize("gated,causal", [(True, True), (False, False)])
def test_tp_sharded_layer_matches_unsharded(gated, causal):
    shape = LayerShape(width=32, ffn=64, heads=4, gated=gated, causal=causal)
    params = init_layer(shape, jax.random.key(1))
    x = jax.random.normal(jax.random.key(2), (1, 12, 32))
    ref = layer_forward(shape, params, x)
    mesh = Mesh(np.array(jax.devices()[:4]), ("tp",))
    sharded = {k: jax.device_put(v, NamedSharding(mesh, layer_specs(shape)[k]))
               for k, v in params.items()}
    out = jax.jit(lambda p, x: layer_forward(shape, p, x))(sharded, x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    # causal: the first token's output ignores later tokens
    if causal:
        x2 = x.at[:, 5:].set(0.0)
        assert jnp.allclose(layer_forward(shape, params, x2)[:, :5], ref[:, :5], atol=1e-6)


def test_curve_interpolates_and_extrapolates():
    c = Curve((16, 32, 64), (1.0, 2.0, 5.0), (2.0, 4.0, 10.0))
    assert c(16) == (1.0, 2.0) and c(48) == (3.5, 7.0)
    assert c(96) == pytest.approx((8.0, 16.0))  # slope of the last piece
    assert c(8) == pytest.approx((0.5, 1.0))
    one = Curve((10,), (2.0,), (4.0,))
    assert one(20) == (4.0, 8.0)


def test_profile_tiny_model_roundtrip_and_plan(tmp_path):
    model = tiny_valm()
    wl = orchmllm_like(model, num_samples=32, seed=0)
    sizes = sample_sizes(model, wl, "vision", points=3)
    assert sizes == sorted(sizes) and all(s % 8 == 0 for s in sizes)
    # two devices: TP 4 and 8 cannot be measured (profile_model skips them)
    table = profile_model(model, wl, points=1, repeats=1, max_tokens=64,
                          devices=jax.devices()[:2])
    assert set(table.units) == {"vision", "audio", "llm"}
    assert all(set(c) == {1, 2} for c in table.units.values())
    path = tmp_path / "profile.json"
    table.save(str(path))
    again = ProfileTable.load(str(path))
    assert again == table
    costs = profiled_costs(model, wl, A800, again)
    vis = next(c for c in costs if c.name == "vision")  # 2 layers: no analytic extras
    curve = again.units["vision"][1]
    f = np.mean([sum(curve(n)[0] for n in s) for s in wl.encoder_tokens["vision"]])
    b = np.mean([sum(curve(n)[1] for n in s) for s in wl.encoder_tokens["vision"]])
    assert vis.time_s[1] == pytest.approx(2 * (f + b))
    assert again.dtype == "bfloat16"  # time_layer's default: the models' compute dtype
    res = orchestrate(costs, A800, 8, 8)
    assert res.iteration_time_s > 0 and sum(c.gpus for c in res.choices.values()) <= 8


def test_two_device_profile_still_plans_72b():
    """MLLM-72B on 128 A800s (batch 64) with selective recomputation ("dots") needs the LLM
    at TP > 2 to fit in memory (TP 2 needs PP 80: 162 GPUs): with TP 1 and 2 measured (a
    2-device machine) the planner still finds a plan, at TP 4 or 8. (With every remat
    policy open, full recomputation fits TP 2 at PP 16.)"""
    model = named_config("disttrain/mllm_72b")
    wl = default_workload(model, num_samples=64)
    curve = Curve((1024, 8192), (2e-3, 20e-3), (4e-3, 40e-3))
    half = Curve((1024, 8192), (1.2e-3, 12e-3), (2.4e-3, 24e-3))
    table = ProfileTable("test", {u: {1: curve, 2: half} for u in model.unit_names})
    costs = profiled_costs(model, wl, A800, table, "dots")
    analytic = {c.name: c for c in unit_costs(model, wl, A800, "dots")}
    for cost in costs:  # unmeasured TP: analytic x (measured / analytic at TP 2)
        ref = analytic[cost.name]
        assert set(cost.time_s) == set(ref.time_s) == set(cost.fwd_s) and 8 in ref.time_s
        ratio, fratio = cost.time_s[2] / ref.time_s[2], cost.fwd_s[2] / ref.fwd_s[2]
        assert ratio != pytest.approx(1.0)
        for tp in set(ref.time_s) - {1, 2}:
            assert cost.time_s[tp] == pytest.approx(ref.time_s[tp] * ratio, rel=1e-12)
            assert cost.fwd_s[tp] == pytest.approx(ref.fwd_s[tp] * fratio, rel=1e-12)
    only_measured = tuple(dataclasses.replace(c, time_s={t: v for t, v in c.time_s.items()
                                                         if t <= 2}) for c in costs)
    with pytest.raises(PlanError, match="too few GPUs"):
        orchestrate(only_measured, A800, 128, 64)
    res = orchestrate(costs, A800, 128, 64)
    assert res.choices["llm"].tp in (4, 8)
    assert sum(c.gpus for c in res.choices.values()) <= 128
