"""The compiled 1F1B schedule and timing (schedule/compiled_timing.py) against the
event-walking Python (schedule.py `multimodal_one_f_one_b`, simulate.py `simulate`) on
random unit graphs: the same rows, action for action, and the same start and end of every
action, exactly (floats compared with ==)."""
import random

import numpy as np
import pytest

from mmjax.models.units import UnitDag
from mmjax.schedule.compiled_timing import ChainLayout, makespan, run, schedule_rows
from mmjax.schedule.schedule import multimodal_one_f_one_b
from mmjax.schedule.simulate import simulate
from mmjax.schedule.stage_graph import Action, StageGraph


def random_case(rng: random.Random):
    encoders = rng.sample(["vision", "audio"], rng.randint(0, 2))
    dag = UnitDag.of(encoders + ["llm"] + (["generator"] if rng.random() < 0.5 else []))
    pp = {u: rng.randint(1, 4) for u in dag.names}
    m, chunks = rng.randint(1, 9), {}
    for u in dag.names:
        if pp[u] > 1 and rng.random() < 0.4:
            if not chunks:
                m = pp[u] * rng.randint(1, 3)
            if m % pp[u] == 0:
                chunks[u] = rng.randint(2, 3)
    trainable = {}
    for u in dag.names:
        n = pp[u] * chunks.get(u, 1)
        trainable[u] = (rng.random() < 0.7 if rng.random() < 0.6
                        else tuple(rng.random() < 0.5 for _ in range(n)))
    return dag, pp, chunks, trainable, m


@pytest.mark.parametrize("seed", range(6))
def test_rows_and_times_equal_the_event_walk(seed):
    rng = random.Random(seed)
    for _ in range(60):
        dag, pp, chunks, trainable, m = random_case(rng)
        graph = StageGraph.from_dag(dag, pp, trainable, chunks)
        want = multimodal_one_f_one_b(graph, m)
        lay = ChainLayout.of(dag, pp, chunks, trainable)
        rows = schedule_rows(lay, m)
        assert lay.num_stages == len(graph.physical_stages)
        got = {}
        for st, s in enumerate(graph.physical_stages):
            sl = slice(rows.ptr[st], rows.ptr[st + 1])
            got[s] = [Action("FB"[k], int(b), int(c)) for k, b, c in
                      zip(rows.kind[sl], rows.microbatch[sl], rows.chunk[sl])]
            assert got[s] == want[s], (dag.names, pp, chunks, trainable, m, s)
        node = {graph.physical(v): k for k, v in enumerate(graph.stages)}
        dur_f = np.array([rng.choice([0.0, 0.5, 1.0, rng.random()]) for _ in node])
        dur_b = np.array([rng.choice([0.0, 1.0, rng.random()]) for _ in node])
        comm = rng.choice([0.0, 0.1, rng.random()])
        sim = simulate(want, lambda s, a: (dur_f if a.kind == "F" else dur_b)[
            node[(s, a.chunk)]], graph, comm)
        start, end, _, _, _ = run(lay, rows, dur_f, dur_b, comm)
        for st, s in enumerate(graph.physical_stages):
            for i, a in zip(range(rows.ptr[st], rows.ptr[st + 1]), got[s]):
                assert (start[i], end[i]) == (sim.start[(s, a)], sim.end[(s, a)])
        assert makespan(lay, rows, dur_f, dur_b, comm) == sim.iteration_time
        # with a limit: exact at or above the makespan, above the limit below it
        t = sim.iteration_time
        assert makespan(lay, rows, dur_f, dur_b, comm, limit=t) == t
        if t > 0:
            assert makespan(lay, rows, dur_f, dur_b, comm, limit=0.5 * t) > 0.5 * t


def test_an_interleaved_llm_before_a_generator_raises_warmups_like_the_python():
    """The deadlock-free loop (the generator waits on the LLM's last chunk) at a size the
    planner meets: pp 8, vpp 2, 16 microbatches, a 2-stage generator."""
    dag = UnitDag.of(["vision", "llm", "generator"])
    pp, chunks = {"vision": 2, "llm": 8, "generator": 2}, {"llm": 2}
    graph = StageGraph.from_dag(dag, pp, None, chunks)
    want = multimodal_one_f_one_b(graph, 16)
    rows = schedule_rows(ChainLayout.of(dag, pp, chunks), 16)
    for st, s in enumerate(graph.physical_stages):
        sl = slice(rows.ptr[st], rows.ptr[st + 1])
        assert [Action("FB"[k], int(b), int(c)) for k, b, c in
                zip(rows.kind[sl], rows.microbatch[sl], rows.chunk[sl])] == want[s]
    assert rows.warm.max() > 0
