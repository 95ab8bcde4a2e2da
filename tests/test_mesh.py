"""Sub-meshes: disjoint per unit and stage, TP innermost, Auto axis types (DistTrain §4.1)."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from mmjax.parallel.mesh import stage_mesh, stage_meshes
from mmjax.planner.plan import Plan, UnitPlan


def plan(*units):
    return Plan(tuple(units), global_batch=8, num_microbatches=2)


def ids(mesh):
    return np.vectorize(lambda d: d.id)(mesh.devices).tolist()


def test_stage_meshes_follow_plan_ranges():
    p = plan(UnitPlan("vision", dp=2, tp=1), UnitPlan("llm", dp=1, tp=2, pp=2, layers=(1, 1)),
             UnitPlan("generator", dp=1, tp=1))
    devs = jax.devices()
    m = stage_meshes(p)
    assert list(m) == ["vision", "llm", "generator"]
    assert [len(v) for v in m.values()] == [1, 2, 1]
    assert ids(m["vision"][0]) == [[devs[0].id], [devs[1].id]]
    assert ids(m["llm"][0]) == [[devs[2].id, devs[3].id]]
    assert ids(m["llm"][1]) == [[devs[4].id, devs[5].id]]
    assert ids(m["generator"][0]) == [[devs[6].id]]
    for meshes in m.values():
        for mesh in meshes:
            assert mesh.axis_names == ("dp", "tp")
            assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    used = [d.id for ms in m.values() for mesh in ms for d in mesh.devices.flat]
    assert len(used) == len(set(used)) == p.num_devices


def test_cp_axis_and_tp_innermost():
    p = plan(UnitPlan("llm", dp=2, cp=2, tp=2))
    devs = jax.devices()
    (mesh,) = stage_meshes(p)["llm"]
    assert mesh.axis_names == ("dp", "cp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "cp": 2, "tp": 2}
    got = ids(mesh)
    assert got == [[[devs[0].id, devs[1].id], [devs[2].id, devs[3].id]],
                   [[devs[4].id, devs[5].id], [devs[6].id, devs[7].id]]]


def test_custom_device_list_and_errors():
    devs = jax.devices()[::-1]
    p = plan(UnitPlan("vision", dp=1, tp=2), UnitPlan("llm", dp=2))
    m = stage_meshes(p, devs)
    assert ids(m["vision"][0]) == [[devs[0].id, devs[1].id]]
    assert ids(m["llm"][0]) == [[devs[2].id], [devs[3].id]]
    big = plan(UnitPlan("vision", dp=4, tp=2), UnitPlan("llm", dp=2))
    with pytest.raises(ValueError, match="needs 10 devices .* 8 were given"):
        stage_meshes(big)
    with pytest.raises(ValueError, match="needs 4 devices .* 3 were given"):
        stage_meshes(p, jax.devices()[:3])
    with pytest.raises(ValueError, match="twice"):
        stage_meshes(p, [devs[0]] * 4)
    with pytest.raises(ValueError, match="dp=2 x cp=1 x tp=2"):
        stage_mesh(devs[:3], 2, 2)
