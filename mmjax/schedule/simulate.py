"""Discrete-event simulation of a pipeline schedule (no JAX).

Each stage runs its actions in order; an action starts when its stage is free and its
dependencies (schedule.py's rule) have ended, plus `comm` seconds when a dependency ran
on another stage. The planner and the inter-microbatch reorderer (DistTrain §6, Alg. 3)
use it to cost schedules; `SimResult.trace()` has the same format the runtime's tracing
mode emits, so `scripts/timeline.py` renders both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

from mmjax.schedule.stage_graph import Action, Backward, StageGraph, StageId, stage_name
from mmjax.schedule.dependencies import check_actions, execute, topology

Costs = Callable[[Hashable, Action], float] | Mapping[tuple[Hashable, str], float]


@dataclass(frozen=True)
class SimResult:
    """Start/end of every (stage, action), and per-stage summaries.

    bubble_fraction[s] = 1 - busy[s] / iteration_time. peak_in_flight[s] counts
    (microbatch, chunk) pairs whose F is done and B is not yet done on s: the number of
    activation sets s holds (chunks that run no backward keep nothing). Stages are the
    schedule's keys: physical stages for an interleaved unit, with the chunk per action.
    """

    schedule: Mapping[Hashable, list[Action]]
    stages: tuple[Hashable, ...]
    start: Mapping[tuple[Hashable, Action], float]
    end: Mapping[tuple[Hashable, Action], float]
    iteration_time: float
    busy: Mapping[Hashable, float]
    bubble_fraction: Mapping[Hashable, float]
    peak_in_flight: Mapping[Hashable, int]

    @property
    def mean_bubble_fraction(self) -> float:
        return sum(self.bubble_fraction.values()) / len(self.stages)

    def trace(self) -> list[dict]:
        """One dict per action, {stage, kind, microbatch, chunk, start, end}, stage as a
        string ("llm:0", or "stage:3" for a chain), sorted by start time then stage."""
        items = [(self.start[(s, a)], i, s, a)
                 for i, s in enumerate(self.stages) for a in self.schedule[s]]
        items.sort(key=lambda t: (t[0], t[1]))
        return [dict(stage=stage_name(s), kind=a.kind, microbatch=a.microbatch,
                     chunk=a.chunk, start=start, end=self.end[(s, a)])
                for start, _, s, a in items]


def _cost_fn(costs: Costs, graph: StageGraph | None) -> Callable[[Hashable, Action], float]:
    if callable(costs):
        return costs
    if not isinstance(costs, Mapping):
        raise ValueError(f"costs must be a callable (stage, action) -> seconds or a dict "
                         f"{{(stage, kind): seconds}}, got {type(costs).__name__}")

    def lookup(stage, action):
        if graph is not None and isinstance(stage, StageId) and action.chunk:
            virtual = graph.virtual(stage, action.chunk)  # chunk c of s: stage c * pp + s
            if (virtual, action.kind) in costs:
                return costs[(virtual, action.kind)]
        try:
            return costs[(stage, action.kind)]
        except KeyError:
            raise ValueError(f"costs has no entry for ({stage!r}, {action.kind!r}); give "
                             "every (stage, kind) pair that the schedule runs") from None
    return lookup


def simulate(schedule, costs: Costs, graph: StageGraph | None = None,
             comm: float = 0.0) -> SimResult:
    """Simulate `schedule` (list per stage, or dict by StageId with `graph`) with per-action
    `costs` in seconds and inter-stage latency `comm`. A callable gets (stage, action); a
    dict is keyed by (stage, kind), and for a chunk c > 0 of an interleaved unit first by
    (virtual stage c * pp + s, kind). Raises ValueError on a malformed or deadlocking
    schedule, or a negative cost."""
    if comm < 0:
        raise ValueError(f"comm={comm}: latency must be >= 0")
    topo = topology(schedule, graph)
    check_actions(schedule, topo)
    cost = _cost_fn(costs, graph)
    durations: dict[tuple[Hashable, Action], float] = {}

    def duration(stage, action):
        d = float(cost(stage, action))
        if d < 0:
            raise ValueError(f"cost of {action} on {stage_name(stage)} is {d} < 0")
        durations[(stage, action)] = d
        return d

    start, end, stuck = execute(schedule, topo, duration, comm)
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(stuck))
    iteration = max(end.values(), default=0.0)
    busy = {s: sum(durations[(s, a)] for a in schedule[s]) for s in topo.stages}
    bubble = {s: (1.0 - busy[s] / iteration) if iteration > 0 else 0.0 for s in topo.stages}
    peak = {}
    for s in topo.stages:
        live = best = 0
        for a in schedule[s]:
            if topo.runs_backward(s, a.chunk):
                live += 1 if a.kind == "F" else -1
                best = max(best, live)
        peak[s] = best
    return SimResult(schedule={s: list(schedule[s]) for s in topo.stages},
                     stages=topo.stages, start=start, end=end, iteration_time=iteration,
                     busy=busy, bubble_fraction=bubble, peak_in_flight=peak)


def frozen_aware_costs(graph: StageGraph, forward: Mapping[StageId, float],
                       ) -> dict[tuple[StageId, str], float]:
    """Cornstarch's backward-time rule (Cornstarch §4.2): T_backward = 0 with nothing
    trainable at or before the stage, 1x T_forward for a frozen stage with trainable
    modules upstream (input grads only), 2x T_forward for a trainable stage (the paper's
    rule, also for a first trainable stage whose backward skips the input gradient). Keyed by
    the graph's (virtual) stages, which `simulate` looks up for interleaved units."""
    factor = {Backward.NONE: 0.0, Backward.INPUT_ONLY: 1.0, Backward.PARAMS: 2.0,
              Backward.FULL: 2.0}
    out = {}
    for s in graph.stages:
        if s not in forward:
            raise ValueError(f"forward has no time for stage {s}; give one per stage")
        out[(s, "F")] = float(forward[s])
        out[(s, "B")] = factor[graph.has_backward[s]] * float(forward[s])
    return out
