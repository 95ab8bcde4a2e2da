"""Pipeline schedules as data: per stage, the ordered list of actions it runs (no JAX).

A schedule is either a list indexed by pipeline stage (`gpipe`, `one_f_one_b`,
`interleaved_one_f_one_b`: one chain of stages, model chunk c of stage s is virtual stage
`c * num_stages + s`) or a dict keyed by physical `StageId` over a `StageGraph` (the unit DAG
of `multimodal_one_f_one_b`: encoder branches in parallel -> LLM stages -> generator,
Cornstarch §4.1 modality parallelism, Fig. 6; a unit with `num_chunks = v > 1` runs Megatron-LM's
interleaved order on its `pp` physical stages, chunk c of physical stage s being the unit's
virtual stage `c * pp + s`). Each action is `Action("F"|"B", microbatch, chunk)`.

A node is (physical stage, chunk), i.e. one virtual stage. Dependencies (the single rule
used by `validate`, `dispatch_order` and `simulate.py`):
- F(mb, c) on a node needs F(mb, c') on every predecessor node (activations flow forward);
- B(mb, c) on a node needs F(mb, c) on the same node and B(mb, c') on every successor node
  that runs a backward (gradients flow back); nodes that run no backward (Cornstarch §4.2,
  frozen with nothing trainable upstream) have no B actions and are never waited for.
A stage runs its actions strictly in list order. The host-driven runtime dispatches the
actions of all stages in one global order (`dispatch_order`); JAX runs each device's work
in dispatch order, so a stage's row is exactly what its devices execute.
"""
from __future__ import annotations

from mmjax.schedule.dependencies import run_schedule, topology
from mmjax.schedule.stage_graph import Action, StageGraph, StageId


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: must be an int >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: must be an int >= 1")


def _warmup_steady_cooldown(num_warmup: int, num_microbatches: int) -> list[Action]:
    """1F1B on one stage (Megatron-LM, Narayanan et al., 2021, §2.2): `num_warmup` forwards,
    then alternate one forward and one backward, then drain the remaining backwards."""
    w = min(num_warmup, num_microbatches)
    order = [Action("F", i) for i in range(w)]
    for i in range(num_microbatches - w):
        order += [Action("F", w + i), Action("B", i)]
    order += [Action("B", i) for i in range(num_microbatches - w, num_microbatches)]
    return order


def gpipe(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs all forwards, then all backwards (in microbatch order)."""
    _check_sizes(num_stages, num_microbatches)
    row = ([Action("F", i) for i in range(num_microbatches)]
           + [Action("B", i) for i in range(num_microbatches)])
    return [list(row) for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_microbatches: int) -> list[list[Action]]:
    """Megatron-LM's non-interleaved 1F1B (Narayanan et al., 2021, §2.2): stage s warms up with
    min(num_stages - s - 1, num_microbatches) forwards, so it holds at most
    num_stages - s microbatches in flight."""
    _check_sizes(num_stages, num_microbatches)
    return [_warmup_steady_cooldown(num_stages - s - 1, num_microbatches)
            for s in range(num_stages)]


def _interleaved_step(p: int, v: int, k: int, forward: bool) -> Action:
    """Megatron-LM's virtual step k on a stage: chunk (k mod (p*v)) // p (reversed for
    backward) of microbatch (k // (p*v)) * p + k mod p."""
    chunk = (k % (p * v)) // p
    mb = (k // (p * v)) * p + k % p
    return Action("F", mb, chunk) if forward else Action("B", mb, v - 1 - chunk)


def _interleaved_row(p: int, m: int, v: int, warmup: int) -> list[Action]:
    """One stage's interleaved 1F1B row: `warmup` forward steps, then alternate one
    forward step and one backward step, then drain the backward steps."""
    total = m * v
    w = min(warmup, total)
    order = [_interleaved_step(p, v, k, True) for k in range(w)]
    for k in range(total - w):
        order += [_interleaved_step(p, v, w + k, True), _interleaved_step(p, v, k, False)]
    order += [_interleaved_step(p, v, k, False) for k in range(total - w, total)]
    return order


def _megatron_interleaved_warmup(p: int, m: int, v: int, s: int) -> int:
    """Megatron-LM's warm-up for stage s: 2 (p - s - 1) + (v - 1) p forward steps, or all
    m v of them when m == p."""
    return m * v if m == p else min(2 * (p - s - 1) + (v - 1) * p, m * v)


def _check_interleaved(p: int, m: int, v: int, what: str = "num_stages") -> None:
    if not isinstance(v, int) or v < 1:
        raise ValueError(f"num_chunks={v!r}: must be an int >= 1")
    if m % p:
        raise ValueError(f"num_microbatches={m} must be a multiple of {what}={p} for "
                         "the interleaved schedule; pick a multiple or use one_f_one_b")


def interleaved_one_f_one_b(num_stages: int, num_microbatches: int,
                            num_chunks: int) -> list[list[Action]]:
    """Megatron-LM's interleaved 1F1B: each stage holds `num_chunks` model chunks (chunk c
    of stage s is virtual stage c * num_stages + s). Virtual step k runs chunk
    (k mod (p*v)) // p (reversed for backward) on microbatch (k // (p*v)) * p + k mod p;
    warm-up is 2 (p - s - 1) + (v - 1) p steps, or everything when m == p."""
    _check_sizes(num_stages, num_microbatches)
    p, m, v = num_stages, num_microbatches, num_chunks
    _check_interleaved(p, m, v)
    return [_interleaved_row(p, m, v, _megatron_interleaved_warmup(p, m, v, s))
            for s in range(p)]


def multimodal_one_f_one_b(graph: StageGraph,
                           num_microbatches: int) -> dict[StageId, list[Action]]:
    """1F1B over the unit DAG (Cornstarch §4.1, Fig. 6), keyed by physical stage: encoder
    branches run in parallel and feed the LLM, which feeds the generator.

    A unit with one chunk: each stage warms up with as many forwards as there are
    (virtual) stages downstream of it on its path, capped by num_microbatches (Fig. 6).
    An interleaved unit (`graph.chunks[unit] = v > 1`, num_microbatches a multiple of its
    pp): Megatron-LM's interleaved order on each of its physical stages, with warm-up
    2 (pp - s - 1) + (v - 1) pp + d forward steps, d = the stages downstream of the
    unit's last virtual stage (e.g. the generator after the LLM), so with nothing
    downstream the rows are exactly `interleaved_one_f_one_b(pp, m, v)`.
    Stages or chunks that run no backward (Cornstarch §4.2) keep their forwards in order
    and drop their B actions.

    Where these warm-ups would deadlock -- e.g. a generator with a 1F1B warm-up wants the
    LLM's last chunk of a microbatch that the interleaved order only produces in the next
    round of p v steps -- the warm-up of a stage that holds back a forward another stage
    waits for (it is at a backward) is raised by one, until the schedule runs (it always
    does: with all forwards first every stage follows one consistent microbatch order).
    """
    _check_sizes(1, num_microbatches)
    m = num_microbatches
    warm: dict[StageId, int] = {}
    cap: dict[StageId, int] = {}
    for s in graph.physical_stages:
        p, v = graph.num_stages(s.unit), graph.num_chunks(s.unit)
        cap[s] = m * v
        if v == 1:
            warm[s] = graph.num_downstream(s)
        else:
            _check_interleaved(p, m, v, f"the pp of unit {s.unit!r}")
            last = StageId(s.unit, p * v - 1)
            warm[s] = m * v if m == p else (_megatron_interleaved_warmup(p, m, v, s.index)
                                            + graph.num_downstream(last))

    def row(s: StageId) -> list[Action]:
        p, v = graph.num_stages(s.unit), graph.num_chunks(s.unit)
        if v == 1:
            if not graph.runs_backward(s):
                return [Action("F", i) for i in range(m)]
            return _warmup_steady_cooldown(warm[s], m)
        keep = {c for c in range(v) if graph.runs_backward(graph.virtual(s, c))}
        return [a for a in _interleaved_row(p, m, v, warm[s])
                if a.kind == "F" or a.chunk in keep]

    out = {s: row(s) for s in graph.physical_stages}
    topo = topology(out, graph)
    while True:
        _, end, pos = run_schedule(out, topo, lambda s, a: 1.0)
        stuck = {s: out[s][pos[s]] for s in topo.stages if pos[s] < len(out[s])}
        if not stuck:
            return out
        at_b = [s for s, a in stuck.items() if a.kind == "B" and warm[s] < cap[s]]
        holding = {d for s, a in stuck.items() if a.kind == "F"
                   for d, da in topo.dependencies(s, a) if (d, da) not in end}
        raise_ = [s for s in at_b if s in holding] or at_b
        if not raise_:
            raise RuntimeError("internal: multimodal_one_f_one_b could not make the "
                               f"schedule deadlock-free (stuck: {list(map(str, stuck))})")
        for s in raise_:
            warm[s] += 1
            out[s] = row(s)
