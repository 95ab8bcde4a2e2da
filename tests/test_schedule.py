"""Schedule tables against independent references and hand-written tables; validate."""
import pytest
from hypothesis import given, settings, strategies as st

from mmjax.schedule.stage_graph import Action, StageGraph, StageId
from mmjax.schedule.schedule import (gpipe, interleaved_one_f_one_b, multimodal_one_f_one_b,
                                     one_f_one_b)
from mmjax.schedule.dependencies import validate


def table(*rows: str) -> list[list[Action]]:
    """Hand-written rows like "F0 F1 B0.1" -> actions (parser kept local to the test)."""
    out = []
    for row in rows:
        acts = []
        for tok in row.split():
            mb, _, chunk = tok[1:].partition(".")
            acts.append(Action(tok[0], int(mb), int(chunk or 0)))
        out.append(acts)
    return out


def strs(schedule):
    return [" ".join(map(str, row)) for row in schedule]


# ---- independent references ---------------------------------------------------------------
def megatron_1f1b_reference(p, m):
    """Megatron-LM forward_backward_pipelining_without_interleaving, written as its three
    loops with explicit counters."""
    tables = []
    for rank in range(p):
        warm = p - rank - 1
        if warm > m:
            warm = m
        rem = m - warm
        row, next_f, next_b = [], 0, 0
        for _ in range(warm):
            row.append(("F", next_f, 0))
            next_f += 1
        for _ in range(rem):
            row.append(("F", next_f, 0))
            next_f += 1
            row.append(("B", next_b, 0))
            next_b += 1
        while next_b < m:
            row.append(("B", next_b, 0))
            next_b += 1
        tables.append([Action(*t) for t in row])
    return tables


def megatron_interleaved_reference(p, m, v):
    """Megatron-LM forward_backward_pipelining_with_interleaving: chunk ids from
    get_model_chunk_id, microbatch ids from per-chunk FIFO queues (the k-th forward of a
    chunk is that chunk's k-th microbatch; backwards pop in the same order)."""
    total = m * v

    def chunk_id(k, forward):
        c = (k % (p * v)) // p
        return c if forward else v - c - 1

    tables = []
    for rank in range(p):
        if m == p:
            warm = total
        else:
            warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
        fcount, bcount = [0] * v, [0] * v
        row = []

        def fwd(k):
            c = chunk_id(k, True)
            row.append(Action("F", fcount[c], c))
            fcount[c] += 1

        def bwd(k):
            c = chunk_id(k, False)
            row.append(Action("B", bcount[c], c))
            bcount[c] += 1

        for k in range(warm):
            fwd(k)
        for k in range(total - warm):
            fwd(k + warm)
            bwd(k)
        for k in range(total - warm, total):
            bwd(k)
        tables.append(row)
    return tables


# ---- Action / StageId -----------------------------------------------------------------------
def test_action_str_and_parse():
    assert str(Action("F", 3)) == "F3"
    assert str(Action("B", 3, 1)) == "B3.1"
    assert Action.parse("B3.1") == Action("B", 3, 1)
    assert Action.parse("F12") == Action("F", 12, 0)
    with pytest.raises(ValueError, match="kind"):
        Action("W", 0)
    with pytest.raises(ValueError, match="microbatch"):
        Action("F", -1)
    with pytest.raises(ValueError, match="parse"):
        Action.parse("X1")
    assert str(StageId("llm", 0)) == "llm:0"
    assert StageId.parse("vision:2") == StageId("vision", 2)


# ---- linear schedules -----------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", range(1, 9))
def test_1f1b_equals_megatron(p, m):
    got = one_f_one_b(p, m)
    assert got == megatron_1f1b_reference(p, m)
    validate(got)


def test_1f1b_literal_tables():
    assert one_f_one_b(2, 4) == table("F0 F1 B0 F2 B1 F3 B2 B3",
                                      "F0 B0 F1 B1 F2 B2 F3 B3")
    assert one_f_one_b(4, 8) == table(
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7")
    # fewer microbatches than stages: warm-up is capped, GPipe-like on early stages
    assert one_f_one_b(4, 2) == table("F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1",
                                      "F0 B0 F1 B1")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("m", range(1, 9))
def test_interleaved_equals_megatron(p, v, m):
    if m % p:
        with pytest.raises(ValueError, match="multiple of num_stages"):
            interleaved_one_f_one_b(p, m, v)
        return
    got = interleaved_one_f_one_b(p, m, v)
    assert got == megatron_interleaved_reference(p, m, v)
    validate(got)


def test_interleaved_literal_tables():
    assert interleaved_one_f_one_b(2, 4, 2) == table(
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3")
    # m == p: Megatron runs all forwards, then all backwards
    assert interleaved_one_f_one_b(2, 2, 2) == table(
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1", "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1")


def test_gpipe_table():
    assert gpipe(3, 3) == table(*["F0 F1 F2 B0 B1 B2"] * 3)
    validate(gpipe(4, 8))


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_stages"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match="num_chunks"):
        interleaved_one_f_one_b(2, 4, 0)


# ---- unit DAG --------------------------------------------------------------------------------
V, A, L0, L1, G = (StageId("vision", 0), StageId("audio", 0), StageId("llm", 0),
                   StageId("llm", 1), StageId("generator", 0))


def by_stage(sched):
    return {str(s): " ".join(map(str, row)) for s, row in sched.items()}


def test_graph_structure():
    g = StageGraph.from_units({"vision": 1, "audio": 2}, llm=2, generator=1)
    A1 = StageId("audio", 1)
    assert g.stages == (V, A, A1, L0, L1, G)
    assert set(g.edges) == {(V, L0), (A, A1), (A1, L0), (L0, L1), (L1, G)}
    assert [g.num_downstream(s) for s in g.stages] == [3, 4, 3, 2, 1, 0]
    # first stages need no input gradient ("params"); everything downstream is "full"
    assert [g.has_backward[s] for s in g.stages] == [
        "params", "params", "full", "full", "full", "full"]


def test_multimodal_literal_table():
    g = StageGraph.from_units({"vision": 1, "audio": 1}, llm=2, generator=1,
                              trainable={"vision": True, "audio": True, "llm": True,
                                         "generator": True})
    sched = multimodal_one_f_one_b(g, 4)
    assert by_stage(sched) == {
        "vision:0": "F0 F1 F2 F3 B0 B1 B2 B3",
        "audio:0": "F0 F1 F2 F3 B0 B1 B2 B3",
        "llm:0": "F0 F1 F2 B0 F3 B1 B2 B3",
        "llm:1": "F0 F1 B0 F2 B1 F3 B2 B3",
        "generator:0": "F0 B0 F1 B1 F2 B2 F3 B3",
    }
    validate(sched, g)


def test_multimodal_uneven_branches_table():
    # a 3-stage audio branch warms up deeper than a 1-stage vision branch (Fig. 6c)
    g = StageGraph.from_units({"vision": 1, "audio": 3}, llm=1)
    sched = multimodal_one_f_one_b(g, 5)
    assert by_stage(sched) == {
        "vision:0": "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "audio:0": "F0 F1 F2 F3 B0 F4 B1 B2 B3 B4",
        "audio:1": "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4",
        "audio:2": "F0 F1 B0 F2 B1 F3 B2 F4 B3 B4",
        "llm:0": "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4",
    }
    validate(sched, g)


def test_frozen_encoders_run_no_backward():
    g = StageGraph.from_units({"vision": 1, "audio": 1}, llm=2, generator=1,
                              trainable={"vision": False, "audio": False, "llm": True,
                                         "generator": True})
    assert g.has_backward == {V: "none", A: "none", L0: "params", L1: "full", G: "full"}
    sched = multimodal_one_f_one_b(g, 4)
    assert by_stage(sched) == {
        "vision:0": "F0 F1 F2 F3",
        "audio:0": "F0 F1 F2 F3",
        "llm:0": "F0 F1 F2 B0 F3 B1 B2 B3",
        "llm:1": "F0 F1 B0 F2 B1 F3 B2 B3",
        "generator:0": "F0 B0 F1 B1 F2 B2 F3 B3",
    }
    validate(sched, g)


def test_frozen_llm_with_trainable_projector_is_input_only():
    # encoder frozen except its last stage (the projector); llm and generator frozen
    g = StageGraph.from_units({"vision": 2, "audio": 1}, llm=2, generator=1,
                              trainable={"vision": (False, True), "audio": False,
                                         "llm": False, "generator": False})
    V1 = StageId("vision", 1)
    assert g.has_backward == {V: "none", V1: "params", A: "none", L0: "input_only",
                              L1: "input_only", G: "input_only"}
    sched = multimodal_one_f_one_b(g, 4)
    assert by_stage(sched) == {
        "vision:0": "F0 F1 F2 F3",
        "vision:1": "F0 F1 F2 F3 B0 B1 B2 B3",
        "audio:0": "F0 F1 F2 F3",
        "llm:0": "F0 F1 F2 B0 F3 B1 B2 B3",
        "llm:1": "F0 F1 B0 F2 B1 F3 B2 B3",
        "generator:0": "F0 B0 F1 B1 F2 B2 F3 B3",
    }
    validate(sched, g)


def test_only_generator_trainable():
    g = StageGraph.from_units({"vision": 1}, llm=2, generator=1,
                              trainable={"vision": False, "llm": False, "generator": True})
    assert [g.has_backward[s] for s in g.stages] == ["none", "none", "none", "params"]
    sched = multimodal_one_f_one_b(g, 3)
    assert by_stage(sched) == {"vision:0": "F0 F1 F2", "llm:0": "F0 F1 F2",
                               "llm:1": "F0 F1 F2", "generator:0": "F0 B0 F1 B1 F2 B2"}
    validate(sched, g)


def test_graph_errors():
    with pytest.raises(ValueError, match="no entry for unit 'audio'"):
        StageGraph.from_units({"vision": 1, "audio": 1}, 2, 0,
                              trainable={"vision": True, "llm": True})
    with pytest.raises(ValueError, match=r"trainable\['vision'\]"):
        StageGraph.from_units({"vision": 2}, 1, 0, trainable={"vision": (True,), "llm": True})
    with pytest.raises(ValueError, match="llm="):
        StageGraph.from_units({"vision": 1}, 0)
    with pytest.raises(ValueError, match="unknown units"):
        StageGraph.from_units({"vision": 1}, 1, 0, trainable={"vision": True, "llm": True,
                                                              "video": True})
    with pytest.raises(ValueError, match="no gradient can reach"):
        StageGraph((V, L0), ((V, L0),), {V: "full", L0: "none"})


def test_from_plan():
    from mmjax.planner.plan import Plan, UnitPlan
    plan = Plan(units=(UnitPlan("vision", pp=2, frozen=True), UnitPlan("llm", pp=2),
                       UnitPlan("generator", pp=1, frozen=True)),
                global_batch=8, num_microbatches=4)
    g = StageGraph.from_plan(plan)
    assert [(str(s), g.has_backward[s]) for s in g.stages] == [
        ("vision:0", "none"), ("vision:1", "none"), ("llm:0", "params"), ("llm:1", "full"),
        ("generator:0", "input_only")]


# ---- validate -------------------------------------------------------------------------------
def _mm():
    g = StageGraph.from_units({"vision": 1, "audio": 1}, llm=2, generator=1)
    return g, multimodal_one_f_one_b(g, 4)


def test_validate_catches_missing_b():
    g, sched = _mm()
    sched[L0].remove(Action("B", 2))
    with pytest.raises(ValueError, match=r"llm:0 is missing action B2"):
        validate(sched, g)
    rows = one_f_one_b(3, 4)
    rows[1].remove(Action("B", 3))
    with pytest.raises(ValueError, match=r"stage:1 is missing action B3"):
        validate(rows)


def test_validate_catches_duplicated_f():
    g, sched = _mm()
    sched[A].insert(2, Action("F", 1))
    with pytest.raises(ValueError, match=r"audio:0 runs F1 twice"):
        validate(sched, g)


def test_validate_catches_deadlock():
    # stage 0 waits for B0 from stage 1, which waits for F1 from stage 0
    with pytest.raises(ValueError, match=r"deadlocks.*stage:0 is stuck at action #1 B0"):
        validate(table("F0 B0 F1 B1", "F0 F1 B0 B1"))
    # B before its own F on the same stage
    with pytest.raises(ValueError, match=r"stage:1 is stuck at action #0 B0.*F0 on stage:1"):
        validate(table("F0 F1 B0 B1", "B0 F0 F1 B1"))
    # the llm runs microbatches in an order the encoders do not feed
    g, sched = _mm()
    sched[V] = table("F1 F0 F2 F3 B0 B1 B2 B3")[0]
    sched[L0] = table("F0 F1 F2 B0 F3 B1 B2 B3")[0]
    validate(sched, g)  # reordering inside warm-up alone is fine
    sched[V] = table("F0 F1 F2 B0 F3 B1 B2 B3")[0]  # B0 before F3, but llm:0 ...
    sched[L0] = table("F0 F1 F2 F3 B0 B1 B2 B3")[0]  # ... needs F3 before B0
    with pytest.raises(ValueError, match="deadlocks"):
        validate(sched, g)


def test_validate_catches_b_on_frozen_stage_and_graph_mismatch():
    g = StageGraph.from_units({"vision": 1}, llm=1, trainable={"vision": False, "llm": True})
    sched = multimodal_one_f_one_b(g, 2)
    sched[V] = sched[V] + [Action("B", 0), Action("B", 1)]
    with pytest.raises(ValueError, match="vision:0 action #2 B0: this stage runs no backward"):
        validate(sched, g)
    with pytest.raises(ValueError, match="needs graph="):
        validate(sched)
    with pytest.raises(ValueError, match=r"missing \['llm:0'\]"):
        validate({V: sched[V]}, g)
    with pytest.raises(ValueError, match="chunk"):
        validate({V: [Action("F", 0, 1)], L0: [Action("F", 0), Action("B", 0)]}, g)


def test_validate_missing_chunk_and_microbatch_count():
    rows = interleaved_one_f_one_b(2, 4, 2)
    rows[0] = [a for a in rows[0] if a != Action("F", 3, 1)]
    with pytest.raises(ValueError, match=r"stage:0 is missing action F3.1"):
        validate(rows)
    with pytest.raises(ValueError, match="missing action F4"):
        validate(one_f_one_b(2, 4), num_microbatches=5)


# ---- property: every generated unit-DAG schedule is valid with bounded in-flight -------------
@settings(max_examples=40, deadline=None)
@given(enc=st.lists(st.integers(1, 3), min_size=1, max_size=3), llm=st.integers(1, 3),
       gen=st.integers(0, 2), m=st.integers(1, 6), data=st.data())
def test_multimodal_always_valid(enc, llm, gen, m, data):
    encoders = {f"enc{i}": n for i, n in enumerate(enc)}
    units = {**encoders, "llm": llm, **({"generator": gen} if gen else {})}
    trainable = {u: data.draw(st.booleans()) for u in units}
    g = StageGraph.from_units(encoders, llm, gen, trainable)
    sched = multimodal_one_f_one_b(g, m)
    validate(sched, g)
    for s, row in sched.items():
        live = peak = 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        if g.runs_backward(s):
            assert peak == min(g.num_downstream(s) + 1, m)
            assert sum(a.kind == "B" for a in row) == m
        else:
            assert row == [Action("F", i) for i in range(m)]


# ---- interleaved units in the unit DAG (virtual pipeline stages) ---------------------------
def one_f_one_b_row(warmup, m):
    """A 1F1B row with the given warm-up: Megatron's non-interleaved row of stage 0 of a
    (warmup + 1)-stage pipeline (reference above, capped by m there)."""
    return megatron_1f1b_reference(warmup + 1, m)[0]


def test_chunked_graph_structure():
    g = StageGraph.from_units({"vision": 1}, llm=2, generator=1, chunks={"llm": 2})
    L2, L3 = StageId("llm", 2), StageId("llm", 3)
    assert g.stages == (V, L0, L1, L2, L3, G)  # virtual stages: chunk * pp + stage
    assert set(g.edges) == {(V, L0), (L0, L1), (L1, L2), (L2, L3), (L3, G)}
    assert g.physical_stages == (V, L0, L1, G)
    assert [g.physical(s) for s in g.stages] == [(V, 0), (L0, 0), (L1, 0), (L0, 1), (L1, 1),
                                                 (G, 0)]
    assert g.virtual(L1, 1) == L3 and g.virtual(V, 0) == V
    assert g.num_stages("llm") == 2 and g.num_chunks("llm") == 2 and g.num_chunks("vision") == 1
    assert g.num_downstream(V) == 5  # counts virtual stages
    # chunks of 1 are the plain graph
    assert StageGraph.from_units({"vision": 1}, 2, 1, chunks={"llm": 1}) == \
        StageGraph.from_units({"vision": 1}, 2, 1)
    with pytest.raises(ValueError, match=r"trainable\['llm'\].*4 bools \(one per virtual"):
        StageGraph.from_units({"vision": 1}, 2, trainable={"vision": True, "llm": (True,) * 2},
                              chunks={"llm": 2})
    with pytest.raises(ValueError, match="chunks has unknown unit 'video'"):
        StageGraph.from_units({"vision": 1}, 2, chunks={"video": 2})
    with pytest.raises(ValueError, match=r"chunks\['llm'\]=0"):
        StageGraph.from_units({"vision": 1}, 2, chunks={"llm": 0})
    with pytest.raises(ValueError, match=r"StageGraph.chunks\['llm'\]=2: .*dividing the "
                                         r"unit's 3 virtual stages"):
        StageGraph((L0, L1, StageId("llm", 2)), (), {s: "full" for s in (L0, L1,
                   StageId("llm", 2))}, {"llm": 2})


def test_from_plan_interleaved():
    from mmjax.planner.plan import Plan, UnitPlan
    plan = Plan(units=(UnitPlan("vision", frozen=True), UnitPlan("llm", pp=2, num_chunks=2),
                       UnitPlan("generator")), global_batch=8, num_microbatches=4)
    g = StageGraph.from_plan(plan)
    assert [str(s) for s in g.stages] == ["vision:0", "llm:0", "llm:1", "llm:2", "llm:3",
                                          "generator:0"]
    assert g.chunks == {"llm": 2} and [str(s) for s in g.physical_stages] == [
        "vision:0", "llm:0", "llm:1", "generator:0"]
    assert g.has_backward[V] == "none" and g.has_backward[StageId("llm", 3)] == "full"


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("encoders", [{}, {"vision": 1, "audio": 2}])
def test_multimodal_interleaved_llm_equals_megatron(p, v, encoders):
    """No generator: every LLM physical stage runs exactly Megatron's interleaved row;
    encoder stages run 1F1B warming up with the stages downstream, counting the LLM's
    p * v virtual stages (Cornstarch Fig. 6)."""
    for m in range(p, 9, p):
        g = StageGraph.from_units(encoders, p, chunks={"llm": v})
        sched = multimodal_one_f_one_b(g, m)
        assert [sched[StageId("llm", s)] for s in range(p)] == \
            megatron_interleaved_reference(p, m, v)
        for name, n in encoders.items():
            for s in range(n):
                assert sched[StageId(name, s)] == one_f_one_b_row(n - 1 - s + p * v, m)
        validate(sched, g)


def test_multimodal_interleaved_literal_table():
    # p=2, v=2, m=4. Forward steps F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1, backward steps
    # B0.1 B1.1 B0 B1 B2.1 B3.1 B2 B3 (Megatron); warm-up 2 (p-s-1) + (v-1) p + 1 for the
    # generator downstream: 5 on llm:0, 3 on llm:1. vision warms up with 4 + 1 >= m.
    g = StageGraph.from_units({"vision": 1}, llm=2, generator=1, chunks={"llm": 2})
    sched = multimodal_one_f_one_b(g, 4)
    assert by_stage(sched) == {
        "vision:0": "F0 F1 F2 F3 B0 B1 B2 B3",
        "llm:0": "F0 F1 F0.1 F1.1 F2 F3 B0.1 F2.1 B1.1 F3.1 B0 B1 B2.1 B3.1 B2 B3",
        "llm:1": "F0 F1 F0.1 F1.1 B0.1 F2 B1.1 F3 B0 F2.1 B1 F3.1 B2.1 B3.1 B2 B3",
        "generator:0": "F0 B0 F1 B1 F2 B2 F3 B3",
    }
    validate(sched, g)


def test_multimodal_interleaved_two_generator_stages_raise_warmup():
    """generator:0 (1F1B warm-up 1) needs the LLM's last chunk of microbatch k + 1 before
    it returns the gradient of k; for k = p - 1 that microbatch's last chunk only comes in
    the next round of p v forward steps, so the last LLM stage must warm up with at least
    2 (v - 1) p + 1 forward steps (Megatron's (v - 1) p + 2 would deadlock). The rows
    keep Megatron's forward and backward step sequences."""
    p, v, m = 2, 2, 8
    g = StageGraph.from_units({}, p, 2, chunks={"llm": v})
    sched = multimodal_one_f_one_b(g, m)
    validate(sched, g)
    ref = megatron_interleaved_reference(p, m, v)
    for s in range(p):
        row = sched[StageId("llm", s)]
        assert [a for a in row if a.kind == "F"] == [a for a in ref[s] if a.kind == "F"]
        assert [a for a in row if a.kind == "B"] == [a for a in ref[s] if a.kind == "B"]
    first_b = [a.kind for a in sched[StageId("llm", p - 1)]].index("B")
    assert first_b - 1 >= 2 * (v - 1) * p + 1  # warm-up = forwards before the first B - 1
    # with Megatron's + 2 warm-up (first B after 5 forwards) the schedule deadlocks
    bad = dict(sched)
    bad[StageId("llm", p - 1)] = table("F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 F4 "
                                       "B2.1 F5 B3.1 F4.1 B2 F5.1 B3 F6 B4.1 F7 B5.1 F6.1 B4 "
                                       "F7.1 B5 B6.1 B7.1 B6 B7")[0]
    with pytest.raises(ValueError, match="deadlocks"):
        validate(bad, g)
    assert sched[StageId("generator", 0)] == one_f_one_b_row(1, m)


def test_interleaved_frozen_chunks_drop_their_backward():
    # vision over 2 stages x 2 chunks, only its last virtual stage (the projector)
    # trainable: chunk 0 of both stages and chunk 1 of vision:0 run no backward
    g = StageGraph.from_units({"vision": 2}, 2, 1, {"vision": (False, False, False, True),
                                                    "llm": True, "generator": True},
                              chunks={"vision": 2})
    V1 = StageId("vision", 1)
    assert [g.has_backward[g.virtual(s, c)] for s, c in ((V, 0), (V1, 0), (V, 1), (V1, 1))] \
        == ["none", "none", "none", "params"]
    sched = multimodal_one_f_one_b(g, 4)
    assert by_stage(sched)["vision:0"] == "F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1"
    row = sched[V1]
    assert [a for a in row if a.kind == "F"] == table("F0 F1 F0.1 F1.1 F2 F3 F2.1 F3.1")[0]
    assert [a for a in row if a.kind == "B"] == table("B0.1 B1.1 B2.1 B3.1")[0]
    validate(sched, g)
    bad = dict(sched)
    bad[V1] = row + [Action("B", 0, 0)]
    with pytest.raises(ValueError, match=r"vision:1 action #12 B0: this stage runs no "
                                         r"backward"):
        validate(bad, g)
    bad[V1] = row[:-1]
    with pytest.raises(ValueError, match=r"vision:1 is missing action B3.1"):
        validate(bad, g)
    bad[V1] = row + [Action("F", 0, 2)]
    with pytest.raises(ValueError, match=r"vision:1 action #12 F0.2: chunk >= num_chunks=2"):
        validate(bad, g)
    with pytest.raises(ValueError, match=r"unknown \['llm:2'\]"):
        validate({**sched, StageId("llm", 2): []}, g)


def test_multimodal_interleaved_needs_microbatches_multiple_of_pp():
    g = StageGraph.from_units({}, 2, chunks={"llm": 2})
    with pytest.raises(ValueError, match="num_microbatches=3 must be a multiple of"):
        multimodal_one_f_one_b(g, 3)


def _grid():
    for encoders in ({}, {"a": 1}, {"a": 2}, {"a": 1, "b": 2}):
        for p in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for gen in (0, 1, 2):
                    yield encoders, p, v, gen


FROZEN = ("none", "encoders", "llm", "all_but_generator")


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_multimodal_interleaved_always_valid(p):
    """Grid: 0..2 encoders of 1..2 stages, llm pp p with v = 1..3 chunks, generator of 0..2
    stages, m = multiples of p up to 8, four frozen combinations: every F and B once, no
    deadlock, and every LLM row keeps Megatron's forward/backward step sequences."""
    for encoders, _, v, gen in (c for c in _grid() if c[1] == p):
        units = [*encoders, "llm"] + (["generator"] if gen else [])
        for frozen in FROZEN:
            trainable = {u: not ((frozen == "encoders" and u in encoders)
                                 or (frozen == "llm" and u == "llm")
                                 or (frozen == "all_but_generator" and u != "generator"))
                         for u in units}
            g = StageGraph.from_units(encoders, p, gen, trainable, {"llm": v})
            for m in range(p, 9, p):
                sched = multimodal_one_f_one_b(g, m)
                validate(sched, g)
                if g.runs_backward(StageId("llm", 0)):
                    ref = megatron_interleaved_reference(p, m, v)
                    for s in range(p):
                        row = sched[StageId("llm", s)]
                        for kind in "FB":
                            assert [a for a in row if a.kind == kind] == \
                                [a for a in ref[s] if a.kind == kind]


def test_dispatch_order():
    from mmjax.schedule.dependencies import dispatch_order
    from mmjax.schedule.simulate import simulate
    g = StageGraph.from_units({"vision": 1}, 2, 1, chunks={"llm": 2})
    sched = multimodal_one_f_one_b(g, 4)
    order = dispatch_order(sched, g)
    assert sorted(order, key=str) == sorted(((s, a) for s, r in sched.items() for a in r),
                                            key=str)
    for s, row in sched.items():  # projected on a stage: its row
        assert [a for t, a in order if t == s] == row
    done = set()
    for s, a in order:  # each action after what it needs (virtual graph)
        vs = g.virtual(s, a.chunk)
        if a.kind == "F":
            need = [(p, "F") for p in g.predecessors(vs)]
        else:
            need = [(vs, "F")] + [(n, "B") for n in g.successors(vs) if g.runs_backward(n)]
        assert all((n, k, a.microbatch) in done for n, k in need), (s, a)
        done.add((vs, a.kind, a.microbatch))
    # one chunk: the order of the unit-cost simulation trace
    g1, = (StageGraph.from_units({"vision": 1, "audio": 2}, 2, 1),)
    s1 = multimodal_one_f_one_b(g1, 5)
    trace = simulate(s1, lambda s, a: 1.0, g1).trace()
    assert [(str(s), a) for s, a in dispatch_order(s1, g1)] == [
        (t["stage"], Action(t["kind"], t["microbatch"], t["chunk"])) for t in trace]
    with pytest.raises(ValueError, match="deadlocks"):
        dispatch_order(table("F0 B0 F1 B1", "F0 F1 B0 B1"))
