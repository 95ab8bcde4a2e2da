"""The schedules chosen by name (`train.schedule`, schedule/named.py), each held to an exact
table over the unit DAG, deadlock-free, and timed by the simulator (no JAX)."""
import pytest

from mmjax.errors import UserError
from mmjax.schedule.dependencies import validate
from mmjax.schedule.named import SCHEDULES, multimodal_gpipe, named_schedule
from mmjax.schedule.schedule import gpipe, multimodal_one_f_one_b
from mmjax.schedule.simulate import simulate
from mmjax.schedule.stage_graph import Action, StageGraph, StageId

from test_schedule import megatron_1f1b_reference, megatron_interleaved_reference


def rows(schedule) -> dict[str, str]:
    return {str(s): " ".join(map(str, row)) for s, row in schedule.items()}


def test_gpipe_on_a_chain_is_gpipe():
    """One chain of one-chunk stages: every row is the chain GPipe's."""
    g = StageGraph.from_units({}, 3)
    assert list(multimodal_gpipe(g, 4).values()) == gpipe(3, 4)


def test_gpipe_table_over_the_unit_dag():
    """A frozen vision encoder (no backward, Cornstarch §4.2), a 2-stage LLM, a generator,
    three microbatches: all forwards, then all backwards, each in microbatch order."""
    g = StageGraph.from_units({"vision": 1}, 2, 1, trainable={"vision": False, "llm": True,
                                                     "generator": True})
    assert rows(multimodal_gpipe(g, 3)) == {
        "vision:0": "F0 F1 F2",
        "llm:0": "F0 F1 F2 B0 B1 B2",
        "llm:1": "F0 F1 F2 B0 B1 B2",
        "generator:0": "F0 F1 F2 B0 B1 B2"}
    validate(multimodal_gpipe(g, 3), g)


def test_gpipe_table_with_virtual_stages():
    """An LLM with 2 chunks per stage: chunk 0's forwards, chunk 1's, then the backwards
    of chunk 1 before chunk 0's (gradients flow from the last virtual stage back)."""
    g = StageGraph.from_units({}, 2, chunks={"llm": 2})
    assert rows(multimodal_gpipe(g, 2)) == {
        "llm:0": "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1",
        "llm:1": "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"}
    validate(multimodal_gpipe(g, 2), g)


def test_gpipe_drops_the_backward_of_a_frozen_chunk():
    """A frozen LLM chunk with nothing trainable before it runs forwards only."""
    g = StageGraph.from_units({}, 2, chunks={"llm": 2},
                              trainable={"llm": (False, False, True, True)})
    assert rows(multimodal_gpipe(g, 2)) == {
        "llm:0": "F0 F1 F0.1 F1.1 B0.1 B1.1",
        "llm:1": "F0 F1 F0.1 F1.1 B0.1 B1.1"}
    validate(multimodal_gpipe(g, 2), g)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 4), (4, 8)])
def test_interleaved_is_megatrons_table(p, m):
    g = StageGraph.from_units({}, p, chunks={"llm": 2})
    assert list(named_schedule("interleaved", g, m).values()) == \
        megatron_interleaved_reference(p, m, 2)


def test_one_f_one_b_by_name_is_the_multimodal_table():
    g = StageGraph.from_units({"vision": 2, "audio": 1}, 2, 1)
    assert named_schedule("1f1b", g, 4) == multimodal_one_f_one_b(g, 4)
    chain = StageGraph.from_units({}, 4)
    assert list(named_schedule("1f1b", chain, 6).values()) == megatron_1f1b_reference(4, 6)


def test_interleaved_without_virtual_stages_is_refused():
    g = StageGraph.from_units({}, 2, chunks={"llm": 1})
    with pytest.raises(UserError, match=r"needs virtual stages.*num_chunks"):
        named_schedule("interleaved", g, 4)
    one = StageGraph.from_units({}, 1, chunks={"llm": 2})  # pp 1: nothing to interleave
    with pytest.raises(UserError, match="needs virtual stages"):
        named_schedule("interleaved", one, 4)


def test_unknown_name_is_refused():
    with pytest.raises(UserError, match=r"train.schedule='zb'.*1f1b, interleaved, gpipe"):
        named_schedule("zb", StageGraph.from_units({}, 2), 2)


def test_simulator_times_each_schedule():
    """Equal stages (F = 1, B = 2 s), p = 4, m = 8: GPipe and 1F1B both take
    (m + p - 1)(F + B) = 33 s, but GPipe holds all 8 microbatches on the first stage and
    1F1B only p = 4; interleaved (v = 2, half-size chunks) cuts the bubble to
    (m + (p - 1) / v)(F + B) = 28.5 s."""
    chain = StageGraph.from_units({}, 4)
    costs = {(s, k): t for s in chain.stages for k, t in (("F", 1.0), ("B", 2.0))}
    gp = simulate(named_schedule("gpipe", chain, 8), costs, chain)
    ofob = simulate(named_schedule("1f1b", chain, 8), costs, chain)
    assert gp.iteration_time == ofob.iteration_time == 33.0
    assert gp.peak_in_flight[StageId("llm", 0)] == 8
    assert ofob.peak_in_flight[StageId("llm", 0)] == 4
    inter = StageGraph.from_units({}, 4, chunks={"llm": 2})
    half = {(s, k): t / 2 for s in inter.stages for k, t in (("F", 1.0), ("B", 2.0))}
    assert simulate(named_schedule("interleaved", inter, 8), half, inter).iteration_time == 28.5


def test_every_name_is_listed_and_runs():
    g = StageGraph.from_units({"vision": 1}, 2, 1, chunks={"llm": 2})
    for name in SCHEDULES:
        sched = named_schedule(name, g, 4)
        validate(sched, g)
        assert all(isinstance(a, Action) for row in sched.values() for a in row)


@pytest.mark.parametrize("seed", range(2))
def test_the_planners_gpipe_rows_and_times_are_the_event_walks(seed):
    """schedule/compiled_named.py `gpipe_rows` (what the planner's timer runs for
    train.schedule="gpipe") against `multimodal_gpipe` and `simulate`, on random unit
    graphs: the same rows, and the same makespan exactly."""
    import random

    import numpy as np

    from mmjax.schedule.compiled_named import gpipe_rows
    from mmjax.schedule.compiled_timing import ChainLayout, makespan
    from test_compiled_timing import random_case

    rng = random.Random(seed)
    for _ in range(30):
        dag, pp, chunks, trainable, m = random_case(rng)
        graph = StageGraph.from_dag(dag, pp, trainable, chunks)
        want = multimodal_gpipe(graph, m)
        lay = ChainLayout.of(dag, pp, chunks, trainable)
        rows = gpipe_rows(lay, m)
        for st, s in enumerate(graph.physical_stages):
            sl = slice(rows.ptr[st], rows.ptr[st + 1])
            assert [Action("FB"[k], int(b), int(c)) for k, b, c in
                    zip(rows.kind[sl], rows.microbatch[sl], rows.chunk[sl])] == want[s]
        node = {graph.physical(v): k for k, v in enumerate(graph.stages)}
        dur_f = np.array([rng.random() for _ in node])
        dur_b = np.array([rng.random() for _ in node])
        sim = simulate(want, lambda s, a: (dur_f if a.kind == "F" else dur_b)[
            node[(s, a.chunk)]], graph, 0.1)
        assert makespan(lay, rows, dur_f, dur_b, 0.1) == sim.iteration_time


def test_the_planners_timer_prices_gpipe_like_1f1b_on_a_chain():
    """One chain of equal stages: GPipe's iteration is 1F1B's, (m + p - 1) stage times."""
    from mmjax.planner.evaluate import Choice
    from mmjax.planner.schedule_time import schedule_time
    from test_planner_schedule_time import HW, unit

    llm, ch = unit("llm", 3.0), {"llm": Choice(1, 1, 4)}
    gp, ofob = (schedule_time((llm,), ch, 8, HW, name) for name in ("gpipe", "1f1b"))
    assert gp == pytest.approx(ofob, rel=1e-12)
    assert gp == pytest.approx((8 + 4 - 1) * 3.0 / 4, rel=1e-12)
