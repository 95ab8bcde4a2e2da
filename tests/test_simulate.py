"""Simulator: closed-form pipeline times, bubbles, in-flight counts, comm, frozen costs."""
import pytest

from mmjax.schedule.stage_graph import Action, StageGraph, StageId
from mmjax.schedule.schedule import (gpipe, interleaved_one_f_one_b, multimodal_one_f_one_b,
                                     one_f_one_b)
from mmjax.schedule.simulate import frozen_aware_costs, simulate

F, B = 1.0, 2.0  # powers of two / small integers: every sum below is exact in floats


def uniform(f=F, b=B, chunks=1):
    return lambda stage, a: (f if a.kind == "F" else b) / chunks


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_1f1b_uniform_closed_form(p, m):
    r = simulate(one_f_one_b(p, m), uniform())
    assert r.iteration_time == (m + p - 1) * (F + B)
    for s in range(p):
        assert r.busy[s] == m * (F + B)
        assert r.bubble_fraction[s] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        assert r.peak_in_flight[s] == min(p - s, m)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 2)])
def test_gpipe_uniform(p, m):
    r = simulate(gpipe(p, m), uniform())
    assert r.iteration_time == (m + p - 1) * (F + B)
    assert all(r.peak_in_flight[s] == m for s in range(p))


def test_1f1b_exact_start_times():
    r = simulate(one_f_one_b(2, 2), uniform())
    # stage 0: F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; stage 1: F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]
    want = {(0, "F0"): (0, 1), (0, "F1"): (1, 2), (0, "B0"): (4, 6), (0, "B1"): (7, 9),
            (1, "F0"): (1, 2), (1, "B0"): (2, 4), (1, "F1"): (4, 5), (1, "B1"): (5, 7)}
    got = {(s, str(a)): (r.start[(s, a)], r.end[(s, a)]) for s in range(2)
           for a in r.schedule[s]}
    assert got == want
    assert r.iteration_time == 9


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (3, 6, 3), (4, 4, 2)])
def test_interleaved_reduces_bubble(p, m, v):
    plain = simulate(one_f_one_b(p, m), uniform())
    inter = simulate(interleaved_one_f_one_b(p, m, v), uniform(chunks=v))
    assert inter.iteration_time < plain.iteration_time
    assert inter.mean_bubble_fraction < plain.mean_bubble_fraction
    # Megatron-LM's bubble for the interleaved schedule: (p - 1) (f + b) / v
    assert inter.iteration_time == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)


def test_comm_latency():
    # p=2, m=1: F0 on 0, send, F0 on 1, B0 on 1, send, B0 on 0
    r = simulate(one_f_one_b(2, 1), uniform(), comm=0.5)
    assert r.iteration_time == F + 0.5 + F + B + 0.5 + B
    with pytest.raises(ValueError, match="comm"):
        simulate(one_f_one_b(2, 1), uniform(), comm=-1)


def test_costs_dict_equals_callable_and_missing_key():
    p, m = 3, 5
    costs = {(s, k): (s + 1) * (1.0 if k == "F" else 2.5) for s in range(p) for k in "FB"}
    a = simulate(one_f_one_b(p, m), costs)
    b = simulate(one_f_one_b(p, m), lambda s, act: costs[(s, act.kind)])
    assert a.start == b.start and a.end == b.end
    # heterogeneous stages: the slowest stage (s=2, 7.0 per F+B) bounds the steady state
    assert a.iteration_time >= m * 7.0
    with pytest.raises(ValueError, match=r"costs has no entry for \(2, 'B'\)"):
        simulate(one_f_one_b(p, m), {k: v for k, v in costs.items() if k != (2, "B")})
    with pytest.raises(ValueError, match="< 0"):
        simulate(one_f_one_b(2, 2), lambda s, act: -1.0)


def test_deadlock_raises():
    rows = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
            [Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)]]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(rows, uniform())


def test_multimodal_parallel_encoders_and_frozen_costs():
    # Fig. 6b of Cornstarch: vision and audio in parallel, both feed the llm
    g = StageGraph.from_units({"vision": 1, "audio": 1}, llm=1)
    V, A, L = StageId("vision", 0), StageId("audio", 0), StageId("llm", 0)
    costs = {(V, "F"): 1.0, (V, "B"): 2.0, (A, "F"): 3.0, (A, "B"): 6.0,
             (L, "F"): 1.0, (L, "B"): 2.0}
    r = simulate(multimodal_one_f_one_b(g, 1), costs, g)
    # llm F0 starts when the slower encoder (audio, 3) is done; both encoder B start at 6
    assert r.start[(L, Action("F", 0))] == 3.0
    assert r.start[(V, Action("B", 0))] == r.start[(A, Action("B", 0))] == 6.0
    assert r.iteration_time == 12.0

    frozen = StageGraph.from_units({"vision": 1, "audio": 1}, llm=2,
                                   trainable={"vision": False, "audio": True, "llm": False})
    fwd = {s: 1.0 for s in frozen.stages}
    c = frozen_aware_costs(frozen, fwd)
    assert c[(V, "B")] == 0.0 and c[(A, "B")] == 2.0 and c[(L, "B")] == 1.0
    m = 4
    r = simulate(multimodal_one_f_one_b(frozen, m), c, frozen)
    assert r.busy[V] == m * 1.0 and r.peak_in_flight[V] == 0  # no backward, nothing kept
    assert r.busy[A] == m * 3.0 and r.peak_in_flight[A] == min(3, m)
    assert r.busy[StageId("llm", 1)] == m * 2.0


def test_trace_format():
    g = StageGraph.from_units({"vision": 1}, llm=2)
    r = simulate(multimodal_one_f_one_b(g, 2), uniform(), g)
    tr = r.trace()
    assert len(tr) == 3 * 4
    assert all(set(d) == {"stage", "kind", "microbatch", "chunk", "start", "end"} for d in tr)
    assert {d["stage"] for d in tr} == {"vision:0", "llm:0", "llm:1"}
    assert [d["start"] for d in tr] == sorted(d["start"] for d in tr)
    assert tr[0] == dict(stage="vision:0", kind="F", microbatch=0, chunk=0, start=0.0, end=1.0)
    inter = simulate(interleaved_one_f_one_b(2, 2, 2), uniform()).trace()
    assert {d["stage"] for d in inter} == {"stage:0", "stage:1"}
    assert {d["chunk"] for d in inter} == {0, 1}


def test_interleaved_unit_in_the_dag_equals_the_chain():
    """An LLM-only unit DAG with num_chunks=2 simulates exactly like Megatron's interleaved
    chain (same rows, same times); dict costs may be keyed by virtual stage c * pp + s."""
    p, m, v = 2, 4, 2
    g = StageGraph.from_units({}, p, chunks={"llm": v})
    sched = multimodal_one_f_one_b(g, m)
    # per virtual stage k: F costs k + 1, B twice that
    per_virtual = {(StageId("llm", k), kind): (k + 1.0) * (1 if kind == "F" else 2)
                   for k in range(p * v) for kind in "FB"}
    r = simulate(sched, per_virtual, g)
    chain = simulate(interleaved_one_f_one_b(p, m, v),
                     lambda s, a: (a.chunk * p + s + 1.0) * (1 if a.kind == "F" else 2))
    assert r.iteration_time == chain.iteration_time
    assert {(s.index, a): t for (s, a), t in r.start.items()} == chain.start
    assert r.peak_in_flight == {StageId("llm", s): chain.peak_in_flight[s] for s in range(p)}
    assert {d["stage"] for d in r.trace()} == {"llm:0", "llm:1"}  # physical stages
    # (physical stage, kind) keys still work and apply to every chunk
    phys = {(StageId("llm", s), kind): 1.0 for s in range(p) for kind in "FB"}
    assert simulate(sched, phys, g).iteration_time == simulate(
        interleaved_one_f_one_b(p, m, v), lambda s, a: 1.0).iteration_time


def test_interleaved_frozen_chunk_keeps_nothing():
    # only the encoder's last virtual stage (vision:3 = chunk 1 of vision:1) is trainable
    g = StageGraph.from_units({"vision": 2}, 1, 0, {"vision": (False, False, False, True),
                                                    "llm": True}, chunks={"vision": 2})
    m = 4
    r = simulate(multimodal_one_f_one_b(g, m), lambda s, a: 1.0, g)
    assert r.peak_in_flight[StageId("vision", 0)] == 0
    # chunk 0 of vision:1 keeps nothing; chunk 1 at most all m microbatches
    assert 1 <= r.peak_in_flight[StageId("vision", 1)] <= m
