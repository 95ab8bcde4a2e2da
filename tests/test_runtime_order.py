"""What each mesh of the pipeline runtime executes: `PipelineRuntime.order` projected onto
one physical mesh (JAX runs a device's work in dispatch order) is that mesh's schedule row.
For an interleaved LLM (num_chunks > 1) that row must be Megatron-LM's interleaved 1F1B
order; the expected rows come from the independent reference in test_schedule.py, written
from Megatron's definition. Building a runtime compiles nothing (jit is lazy), so these
checks are cheap."""
import pytest

from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.pipeline.runtime import PipelineRuntime
from mmjax.schedule.stage_graph import Action, StageId
from mmjax.planner.plan import Plan

from test_schedule import megatron_1f1b_reference, megatron_interleaved_reference


def mesh_rows(rt) -> dict[tuple, list[Action]]:
    """rt.order grouped by the devices of the mesh each action is dispatched on."""
    rows: dict[tuple, list[Action]] = {}
    for sid, act in rt.order:
        key = tuple(d.id for d in rt.stages[sid].mesh.devices.flat)
        rows.setdefault(key, []).append(act)
    return rows


def unit_rows(rt, unit: str) -> list[list[Action]]:
    """The rows of the physical meshes of `unit`, in stage order; checks that every action
    names its virtual stage consistently (chunk c of mesh s is virtual stage c * pp + s)."""
    pp = rt.plan.unit(unit).pp
    rows = mesh_rows(rt)
    for sid, act in rt.order:
        if sid.unit == unit:
            assert (sid.index % pp, sid.index // pp) == (
                rt.meshes[unit].index(rt.stages[sid].mesh), act.chunk)
    return [rows[tuple(d.id for d in rt.meshes[unit][s].devices.flat)] for s in range(pp)]


def assert_dependency_order(rt):
    """Every action exactly once, after what it needs (on the virtual-stage graph)."""
    g = rt.graph
    seen = set()
    for sid, act in rt.order:
        mb = act.microbatch
        if act.kind == "F":
            need = [(p, "F") for p in g.predecessors(sid)]
        else:
            need = [(sid, "F")] + [(s, "B") for s in g.successors(sid) if g.runs_backward(s)]
        for stage, kind in need:
            assert (stage, kind, mb) in seen, (str(sid), str(act), str(stage), kind)
        assert (sid, act.kind, mb) not in seen
        seen.add((sid, act.kind, mb))
    m = rt.plan.num_microbatches
    want = {(s, k, mb) for s in g.stages for mb in range(m)
            for k in (("F", "B") if g.runs_backward(s) else ("F",))}
    assert seen == want


def runtime(cfg, pp, m, v=2, extra_pp=None):
    plan = Plan.uniform(cfg, m, m, pp={"llm": pp, **(extra_pp or {})},
                        num_chunks={"llm": v})
    return PipelineRuntime(cfg, plan)


LLM8 = {"llm.num_layers": 8}


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_llm_only_meshes_run_megatron_interleaved(pp, m):
    cfg = with_overrides(tiny(), LLM8).replace(encoders=(), generator=None)
    rt = runtime(cfg, pp, m)
    assert len(mesh_rows(rt)) == pp
    assert unit_rows(rt, "llm") == megatron_interleaved_reference(pp, m, 2)
    assert_dependency_order(rt)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (4, 4), (4, 8)])
def test_with_encoders_llm_meshes_still_megatron_interleaved(pp, m):
    """Two encoder branches (audio over 2 stages) in front of an interleaved LLM: the LLM
    meshes keep Megatron's order; each encoder stage runs 1F1B with a warm-up of the
    stages downstream of it, counting the LLM's 2 pp virtual stages (Cornstarch Fig. 6)."""
    cfg = with_overrides(tiny_valm(), {**LLM8, "encoders.audio.encoder.num_layers": 2})
    rt = runtime(cfg, pp, m, extra_pp={"audio": 2})
    assert len(mesh_rows(rt)) == pp + 3
    assert unit_rows(rt, "llm") == megatron_interleaved_reference(pp, m, 2)
    # 1F1B with warm-up w == Megatron's non-interleaved row of stage p - 1 - w (capped by m)
    nv = 2 * pp
    for unit, stages in (("vision", 1), ("audio", 2)):
        for s, row in enumerate(unit_rows(rt, unit)):
            warm = stages - 1 - s + nv
            assert row == megatron_1f1b_reference(warm + 1, m)[0], (unit, s)
    assert_dependency_order(rt)


def test_generator_after_interleaved_llm_grows_warmup():
    """A generator after the LLM: the LLM meshes keep the interleaved order (steps and
    chunk sequence) with the warm-up grown by the one stage downstream, and the whole
    dispatch order still respects every dependency."""
    cfg = with_overrides(tiny(), LLM8)
    pp, m, v = 2, 4, 2
    rt = runtime(cfg, pp, m)
    rows = unit_rows(rt, "llm")
    ref = megatron_interleaved_reference(pp, m, v)
    for s in range(pp):
        warm = 2 * (pp - s - 1) + (v - 1) * pp + 1  # Megatron's + 1 generator stage
        assert [a for a in rows[s] if a.kind == "F"] == [a for a in ref[s] if a.kind == "F"]
        assert [a for a in rows[s] if a.kind == "B"] == [a for a in ref[s] if a.kind == "B"]
        assert next(i for i, a in enumerate(rows[s]) if a.kind == "B") == warm + 1
    assert unit_rows(rt, "generator") == [megatron_1f1b_reference(1, m)[0]]
    assert_dependency_order(rt)


def test_non_interleaved_order_unchanged():
    """num_chunks == 1: the runtime's order is the unit-DAG 1F1B of Cornstarch Fig. 6 and
    virtual == physical stages."""
    cfg = with_overrides(tiny(), {})
    plan = Plan.uniform(cfg, 4, 4, pp={"llm": 2})
    rt = PipelineRuntime(cfg, plan)
    assert rt.graph.stages == rt.graph.physical_stages
    assert set(rt.schedule) == set(rt.stages)
    for sid, row in rt.schedule.items():
        assert [a for s, a in rt.order if s == sid] == row
    # llm:0 has llm:1 and the generator downstream (warm-up 2), llm:1 the generator (1)
    assert unit_rows(rt, "llm") == megatron_1f1b_reference(3, 4)[:2]
    assert_dependency_order(rt)
    assert [(str(s), str(a)) for s, a in rt.order[:4]] == [
        ("vision:0", "F0"), ("vision:0", "F1"), ("llm:0", "F0"), ("vision:0", "F2")]
    assert StageId("llm", 1) in rt.schedule
