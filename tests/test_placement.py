"""Node-aware placement (planner/placement.py): every cp*tp group inside one node, every
device owned once, and the planner's 72B plan no longer straddles nodes (no JAX)."""
import random

import pytest

from mmjax.errors import UserError
from mmjax.models.named import named_config
from mmjax.planner.build import plan_model
from mmjax.planner.hardware import A800
from mmjax.planner.placement import contiguous, stage_devices, straddling_groups
from mmjax.planner.plan import UnitPlan


def _units(rng):
    out = []
    for i in range(rng.randint(1, 4)):
        tp, cp = rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2])
        out.append(UnitPlan(name=f"u{i}", dp=rng.randint(1, 3), tp=tp, cp=cp,
                            pp=rng.randint(1, 3)))
    return out


def _check(units, placement, n):
    seen = []
    for u in units:
        assert len(placement[u.name]) == u.pp
        g = u.cp * u.tp
        for devs in placement[u.name]:
            assert len(devs) == u.dp * g
            seen += devs
            for d in range(u.dp):
                grp = devs[d * g:(d + 1) * g]
                nodes = sorted({x // n for x in grp})
                if g <= n:
                    assert len(nodes) == 1, (u, grp)
                else:  # whole consecutive nodes
                    assert len(grp) == len(nodes) * n and nodes == list(
                        range(nodes[0], nodes[0] + len(nodes)))
    total = sum(u.num_devices for u in units)
    assert sorted(seen) == list(range(total))  # every device once, no hole


@pytest.mark.parametrize("seed", range(200))
def test_groups_stay_inside_a_node(seed):
    rng = random.Random(seed)
    units, n = _units(rng), rng.choice([4, 8])
    if any(u.cp * u.tp > n and (u.cp * u.tp) % n for u in units):
        with pytest.raises(UserError, match="devices_per_node"):
            stage_devices(units, n)
        return
    total = sum(u.num_devices for u in units)
    try:
        placement = stage_devices(units, n)
    except UserError as e:  # only a group bigger than a partial last node can fail
        assert total % n and "fragment" in str(e)
        return
    _check(units, placement, n)
    assert straddling_groups(units, placement, n) == 0


def test_contiguous_is_the_old_packing_and_zero_means_it():
    units = [UnitPlan(name="a", dp=3, tp=1), UnitPlan(name="b", dp=1, tp=2, pp=2)]
    assert contiguous(units) == {"a": [[0, 1, 2]], "b": [[3, 4], [5, 6]]}
    assert stage_devices(units, 0) == contiguous(units)
    # node-aware: the two tp-2 groups first (nodes of 4: 0-1, 2-3), then a's three singles
    assert stage_devices(units, 4) == {"a": [[4, 5, 6]], "b": [[0, 1], [2, 3]]}
    assert straddling_groups(units, contiguous(units), 4) == 1  # b's first stage: 3-4


def test_planner_72b_plan_keeps_every_tp_group_in_a_node():
    """The planner's MLLM-72B plan on 112 A800s (8 a node): packed contiguously, TP groups
    cross node boundaries; with the plan's devices_per_node none does."""
    plan = plan_model(named_config("disttrain/mllm_72b"), A800, 112, 240)
    assert plan.devices_per_node == 8
    blind = straddling_groups(plan.units, contiguous(plan.units), 8)
    assert blind > 0
    assert straddling_groups(plan.units, plan.stage_devices(), 8) == 0
    _check(plan.units, plan.stage_devices(), 8)


def test_plan_json_round_trips_devices_per_node():
    from mmjax.planner.plan import Plan, PlanError
    plan = plan_model(named_config("disttrain/mllm_72b"), A800, 112, 240)
    back = Plan.from_json(plan.to_json())
    assert back.devices_per_node == 8 and back.stage_devices() == plan.stage_devices()
    bad = plan.to_json() | {"devices_per_node": "8"}
    with pytest.raises(PlanError, match="devices_per_node"):
        Plan.from_json(bad)


def test_node_map_and_clear_error_for_groups_that_cannot_fit():
    from mmjax.planner.placement import node_map
    units = [UnitPlan(name="llm", dp=2, tp=4, pp=1), UnitPlan(name="vision", dp=1, tp=1)]
    lines = node_map(units, stage_devices(units, 8), 8)
    assert lines == ["node 0 (8 devices): llm:0 dp0 (tp 4), llm:0 dp1 (tp 4)",
                     "node 1 (1 devices): vision:0 dp0"]
    with pytest.raises(UserError, match="cp\\*tp = 12 .* multiple of it"):
        stage_devices([UnitPlan(name="llm", dp=1, tp=4, cp=3)], 8)


def _first_fit_unhinted(units, n):
    """First-fit-decreasing as written before the per-size start hint: every group scans
    the nodes from the first."""
    from mmjax.planner.placement import _take

    total = sum(u.num_devices for u in units)
    groups = [(u.name, s, d, u.cp * u.tp) for u in units for s in range(u.pp)
              for d in range(u.dp)]
    free = [list(range(k * n, min((k + 1) * n, total))) for k in range(-(-total // n))]
    where = {}
    for i in sorted(range(len(groups)), key=lambda i: -groups[i][3]):
        name, s, d, g = groups[i]
        where[(name, s, d)] = _take(free, g, n, name)
    return {u.name: [[x for d in range(u.dp) for x in where[(u.name, s, d)]]
                     for s in range(u.pp)] for u in units}


def test_hinted_first_fit_places_as_the_full_scan():
    """The per-group-size start hint (nodes passed over never regain room) changes no
    placement, nor which mixes cannot be placed, on random unit mixes."""
    import types

    rng = random.Random(0)
    for _ in range(1500):
        units = []
        for i in range(rng.randint(1, 4)):
            tp, dp, pp = rng.choice([1, 2, 4, 8, 3, 16]), rng.randint(1, 6), rng.randint(1, 5)
            cp = rng.choice([1, 1, 2])
            units.append(types.SimpleNamespace(name=f"u{i}", tp=tp, dp=dp, pp=pp, cp=cp,
                                               num_devices=tp * dp * pp * cp,
                                               devices_per_stage=tp * dp * cp))
        outcome = []
        for place in (_first_fit_unhinted, stage_devices):
            try:
                outcome.append(place(units, 8))
            except Exception as e:  # the same error for a mix that fragments the nodes
                outcome.append(type(e))
        assert outcome[0] == outcome[1], units
