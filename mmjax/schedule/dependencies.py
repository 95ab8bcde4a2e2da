"""A schedule's dependencies, execution and checks (no JAX): `topology` (its nodes, their
backward modes and edges), `execute` (an event-driven run with per-action durations, the
simulator's core), `validate` / `check_actions` (every action once, deadlock-free) and
`dispatch_order` (the one global order the host-driven runtime dispatches in). The single
dependency rule is stated in schedule.py's docstring.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Mapping, Sequence, TypeVar, overload

from mmjax.schedule.stage_graph import Action, Backward, StageGraph, StageId, stage_name

Key = tuple[Hashable, Action]  # (stage, action)
S = TypeVar("S", bound=Hashable)  # a stage: int in a chain, StageId over a StageGraph


@dataclass(frozen=True)
class Topology(Generic[S]):
    """A schedule's stages, chunks per stage, and its nodes (stage, chunk): their backward
    modes and the nodes that feed each other. Built by `topology`; shared by `validate`,
    `dispatch_order` and `simulate`."""

    stages: tuple[S, ...]
    chunks: Mapping[S, int]
    has_backward: Mapping[tuple[S, int], Backward]
    preds: Mapping[tuple[S, int], tuple[tuple[S, int], ...]]
    succs: Mapping[tuple[S, int], tuple[tuple[S, int], ...]]

    _deps: dict[tuple[S, Action], list[tuple[S, Action]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_chunks(self) -> int:
        return max(self.chunks.values(), default=1)

    def runs_backward(self, stage: S, chunk: int = 0) -> bool:
        return self.has_backward[(stage, chunk)] is not Backward.NONE

    def dependencies(self, stage: S, action: Action) -> list[tuple[S, Action]]:
        """The (stage, action) pairs that must end before `action` starts on `stage`."""
        key = (stage, action)
        deps = self._deps.get(key)
        if deps is None:
            node = (stage, action.chunk)
            mb = action.microbatch
            if action.kind == "F":
                deps = [(s, Action("F", mb, c)) for s, c in self.preds[node]]
            else:
                deps = [(stage, Action("F", mb, action.chunk))] + [
                    (s, Action("B", mb, c)) for s, c in self.succs[node]
                    if self.runs_backward(s, c)]
            self._deps[key] = deps
        return deps


@overload
def topology(schedule: Mapping[StageId, Sequence[Action]],
             graph: StageGraph | None = None) -> Topology[StageId]: ...
@overload
def topology(schedule: Sequence[Sequence[Action]],
             graph: StageGraph | None = None) -> Topology[int]: ...
def topology(schedule: Any, graph: StageGraph | None = None) -> Topology[Any]:
    """List schedule: a chain of len(schedule) stages, chunks inferred from the actions
    (virtual stage c * p + s), every stage runs a full backward. Dict schedule: keyed by
    the physical stages of `graph` (required); node (stage s, chunk c) is the unit's
    virtual stage c * pp + s, with the graph's edges and backward modes."""
    if isinstance(schedule, Mapping):
        if graph is None:
            raise ValueError("a schedule keyed by StageId needs graph=StageGraph(...) "
                             "to know its edges and backward modes")
        return _graph_topology(schedule, graph)
    if not isinstance(schedule, Sequence) or isinstance(schedule, str):
        raise ValueError(f"schedule must be a list of per-stage action lists or a dict "
                         f"keyed by StageId, got {type(schedule).__name__}")
    if graph is not None:
        raise ValueError("graph= is only for dict schedules keyed by StageId; a list "
                         "schedule is a plain chain of stages")
    return _chain_topology(schedule)


def _graph_topology(schedule: Mapping[StageId, Sequence[Action]],
                    graph: StageGraph) -> Topology[StageId]:
    phys = graph.physical_stages
    known = set(phys)
    missing = [str(s) for s in phys if s not in schedule]
    extra = [stage_name(s) for s in schedule if s not in known]
    if missing or extra:
        raise ValueError(f"schedule stages do not match the graph: missing {missing}, "
                         f"unknown {extra}")
    node = {v: graph.physical(v) for v in graph.stages}
    preds = {node[v]: tuple(node[a] for a in graph.predecessors(v)) for v in graph.stages}
    succs = {node[v]: tuple(node[b] for b in graph.successors(v)) for v in graph.stages}
    modes = {node[v]: graph.has_backward[v] for v in graph.stages}
    chunks = {s: graph.num_chunks(s.unit) for s in phys}
    return Topology(phys, chunks, modes, preds, succs)


def _chain_topology(schedule: Sequence[Sequence[Action]]) -> Topology[int]:
    p = len(schedule)
    if p == 0:
        raise ValueError("schedule has no stages")
    v = 1 + max((a.chunk for row in schedule for a in row if isinstance(a, Action)),
                default=0)
    virtual = [(s, c) for c in range(v) for s in range(p)]  # virtual stage c * p + s
    preds: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {n: () for n in virtual}
    succs: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {n: () for n in virtual}
    for a, b in zip(virtual[:-1], virtual[1:]):
        preds[b] = (a,)
        succs[a] = (b,)
    return Topology(tuple(range(p)), {s: v for s in range(p)},
                    {n: Backward.FULL for n in virtual}, preds, succs)


def run_schedule(schedule, topo: Topology[S], duration: Callable[[S, Action], float],
                 comm: float = 0.0
                 ) -> tuple[dict[tuple[S, Action], float], dict[tuple[S, Action], float],
                            dict[S, int]]:
    """Event loop of `execute`; returns (start, end, position reached in each row)."""
    start: dict[tuple[S, Action], float] = {}
    end: dict[tuple[S, Action], float] = {}
    pos = {s: 0 for s in topo.stages}
    free = {s: 0.0 for s in topo.stages}
    waiting: dict[tuple[S, Action], list[S]] = {}
    queue = deque(topo.stages)
    while queue:
        s = queue.popleft()
        row = schedule[s]
        while pos[s] < len(row):
            a = row[pos[s]]
            t = free[s]
            blocked = None
            for dep in topo.dependencies(s, a):
                e = end.get(dep)
                if e is None:
                    blocked = dep
                    break
                t = max(t, e + (comm if dep[0] != s else 0.0))
            if blocked is not None:
                waiting.setdefault(blocked, []).append(s)
                break
            start[(s, a)] = t
            end[(s, a)] = free[s] = t + duration(s, a)
            pos[s] += 1
            queue.extend(waiting.pop((s, a), ()))
    return start, end, pos


def execute(schedule, topo: Topology[S], duration: Callable[[S, Action], float],
            comm: float = 0.0
            ) -> tuple[dict[tuple[S, Action], float], dict[tuple[S, Action], float], list[str]]:
    """Run every stage's actions in order: an action starts when its stage is free and
    its dependencies have ended (+ `comm` when the dependency is on another stage).
    Returns (start, end, stuck); `stuck` describes each stage that could not finish
    (a deadlock), empty when the schedule runs to completion."""
    start, end, pos = run_schedule(schedule, topo, duration, comm)
    stuck = []
    for s in topo.stages:
        if pos[s] < len(schedule[s]):
            a = schedule[s][pos[s]]
            need = [f"{d} on {stage_name(ds)}" for ds, d in topo.dependencies(s, a)
                    if (ds, d) not in end]
            stuck.append(f"{stage_name(s)} is stuck at action #{pos[s]} {a}, waiting for "
                         f"{', '.join(need)}")
    return start, end, stuck


def check_actions(schedule, topo: Topology, num_microbatches: int | None = None) -> int:
    """Every F, and every B on stages that run a backward, exactly once per (microbatch,
    chunk) on every stage; no B on stages that run none. Returns num_microbatches."""
    m = num_microbatches
    if m is None:
        m = 1 + max((a.microbatch for s in topo.stages for a in schedule[s]
                     if isinstance(a, Action)), default=-1)
    if m < 1:
        raise ValueError("schedule has no actions (num_microbatches would be 0)")
    for s in topo.stages:
        name = stage_name(s)
        seen = set()
        for i, a in enumerate(schedule[s]):
            if not isinstance(a, Action):
                raise ValueError(f"{name} action #{i} is {a!r}, not an Action")
            if a in seen:
                raise ValueError(f"{name} runs {a} twice (again at action #{i})")
            seen.add(a)
            if a.microbatch >= m:
                raise ValueError(f"{name} action #{i} {a}: microbatch >= "
                                 f"num_microbatches={m}")
            if a.chunk >= topo.chunks[s]:
                raise ValueError(f"{name} action #{i} {a}: chunk >= num_chunks="
                                 f"{topo.chunks[s]}")
            if a.kind == "B" and not topo.runs_backward(s, a.chunk):
                raise ValueError(f"{name} action #{i} {a}: this stage runs no backward "
                                 f"{'' if a.chunk == 0 else f'in chunk {a.chunk} '}"
                                 "(has_backward='none'); drop its B actions")
        for c in range(topo.chunks[s]):
            for k in ("F", "B") if topo.runs_backward(s, c) else ("F",):
                for mb in range(m):
                    if Action(k, mb, c) not in seen:
                        raise ValueError(f"{name} is missing action {Action(k, mb, c)}")
    return m


def validate(schedule, graph: StageGraph | None = None,
             num_microbatches: int | None = None) -> None:
    """Raise ValueError (naming the stage and action) unless every F and B appears exactly
    once per (microbatch, chunk) on each stage (B only where the stage runs a backward),
    and the schedule runs to completion under the dependency rule (no deadlock)."""
    topo = topology(schedule, graph)
    check_actions(schedule, topo, num_microbatches)
    _, _, stuck = execute(schedule, topo, lambda s, a: 1.0)
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(stuck))


def dispatch_order(schedule, graph: StageGraph | None = None) -> list[Key]:
    """All (stage, action) pairs of a valid schedule in one global order that respects
    every dependency and keeps each stage's row order: sorted by start time when every
    action takes one unit (ties in stage order). A host-driven runtime dispatching in
    this order hands each stage's devices exactly that stage's row (JAX runs a device's
    work in dispatch order), so per stage the schedule is what runs."""
    topo = topology(schedule, graph)
    check_actions(schedule, topo)
    start, _, stuck = execute(schedule, topo, lambda s, a: 1.0)
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(stuck))
    rank = {s: i for i, s in enumerate(topo.stages)}
    return sorted(start, key=lambda key: (start[key], rank[key[0]]))
