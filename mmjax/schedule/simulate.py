"""The timing model of a pipeline schedule (no JAX): the one recurrence every cost of a
schedule goes through.

Each stage runs its actions in order; an action starts when its stage is free and its
dependencies (schedule.py's rule) have ended, plus `comm` seconds when a dependency ran
on another stage (DistTrain §6.2: "each microbatch's end time is the max of the previous
action on the same device and its upstream input, plus its own computation time").
`Recurrence` compiles a schedule once; `simulate` evaluates it with per-action costs
(`SimResult.trace()` has the runtime's trace format, so `scripts/timeline.py` renders
both); `PipelineModel` is the 1F1B / interleaved 1F1B chain with per-stage affine costs
that the inter-microbatch reorderer (data/reorder.py, DistTrain §6.2 Algorithm 3)
evaluates for many microbatch orders (`batch_iteration_time`).
"""
from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Callable, Generic, Hashable, Mapping, Sequence

import numpy as np

from mmjax.schedule.dependencies import S, Topology, check_actions, execute, topology
from mmjax.schedule.schedule import interleaved_one_f_one_b, one_f_one_b
from mmjax.schedule.stage_graph import Action, Backward, StageGraph, StageId, stage_name

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


@dataclass(frozen=True)
class Recurrence(Generic[S]):
    """A schedule compiled for timing: its (stage, action) keys in an order where every
    dependency comes first, each one's previous action on its stage, and its dependencies
    on other stages (a dependency on its own stage ran before its previous action there).
    `times` evaluates it for any durations."""

    keys: tuple[tuple[S, Action], ...]
    prev: tuple[int, ...]  # -1: first on its stage
    deps: tuple[tuple[int, ...], ...]  # on other stages (they pay comm)

    @classmethod
    def compile(cls, schedule, topo: Topology[S]) -> "Recurrence[S]":
        """Raises ValueError naming the stuck stages when the schedule deadlocks."""
        start, _, stuck = execute(schedule, topo, lambda s, a: 1.0)
        if stuck:
            raise ValueError("schedule deadlocks: " + "; ".join(stuck))
        keys = tuple(start)  # the order the event loop ran them: dependencies first
        index = {k: i for i, k in enumerate(keys)}
        last: dict[S, int] = {}
        prev: list[int] = []
        deps: list[tuple[int, ...]] = []
        for i, (s, a) in enumerate(keys):
            prev.append(last.get(s, -1))
            last[s] = i
            # a dependency on the same stage ran before the previous action there (rows run
            # in order, durations >= 0), so only those on other stages can start it later
            deps.append(tuple(index[d] for d in topo.dependencies(s, a) if d[0] != s))
        return cls(keys, tuple(prev), tuple(deps))

    def times(self, durations: Sequence[float], comm: float = 0.0
              ) -> tuple[list[float], list[float]]:
        """(start, end) per key for `durations` (per key, in `keys` order)."""
        n = len(self.keys)
        start, end = [0.0] * n, [0.0] * n
        for i, p, deps, d in zip(range(n), self.prev, self.deps, durations):
            t = end[p] if p >= 0 else 0.0
            for j in deps:
                e = end[j] + comm
                if e > t:
                    t = e
            start[i] = t
            end[i] = t + d
        return start, end

    def batch_end(self, duration: Callable[[int], np.ndarray], sets: int) -> np.ndarray:
        """The latest end for many duration sets at once: `duration(i)` gives key i's
        durations [sets] (no comm); the same recurrence, one numpy step per key."""
        end: list[np.ndarray] = []  # key i's end, appended in key order
        zero = np.zeros(sets)
        for i, p, deps in zip(range(len(self.keys)), self.prev, self.deps):
            t = end[p] if p >= 0 else zero  # p and deps index earlier keys
            for j in deps:
                t = np.maximum(t, end[j])
            end.append(t + duration(i))
        return np.max(end, axis=0) if end else zero


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

    rec = Recurrence.compile(schedule, topo)
    starts, ends = rec.times([duration(s, a) for s, a in rec.keys], comm)
    start, end = dict(zip(rec.keys, starts)), dict(zip(rec.keys, ends))
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


# ---------------------------------------------------------------------------------------
# The 1F1B chain of the inter-microbatch reorderer (DistTrain §6.2)
# ---------------------------------------------------------------------------------------

def check_stages(num_stages: int, num_chunks: int, num_microbatches: int) -> None:
    """The chain's sizes: positive ints, and p | l for interleaved 1F1B."""
    for name, v in (("num_stages", num_stages), ("num_chunks", num_chunks)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if num_chunks > 1 and num_microbatches % num_stages:
        raise ValueError(
            f"interleaved 1F1B (num_chunks={num_chunks}) needs the number of microbatches "
            f"({num_microbatches}) to be a multiple of num_stages ({num_stages}); pad the batch "
            "or use num_chunks=1")


def stage_affine(stage_costs, p: int) -> list[tuple[float, float, float]]:
    """Per stage (scale, forward offset, backward offset); default (1, 0, 0) everywhere."""
    if stage_costs is None:
        return [(1.0, 0.0, 0.0)] * p
    out = []
    for s, entry in enumerate(stage_costs):
        vals = tuple(float(e) for e in entry) if isinstance(entry, (tuple, list)) else ()
        if len(vals) != 3 or not all(math.isfinite(e) and e >= 0 for e in vals):
            raise ValueError(f"stage_costs[{s}] must be (scale, forward_offset, backward_offset), "
                             f"finite and >= 0, got {entry!r}")
        out.append(vals)
    if len(out) != p:
        raise ValueError(f"stage_costs needs one entry per stage ({p}), got {len(out)}")
    return out


@dataclass(frozen=True)
class PipelineModel:
    """`one_f_one_b(p, l)` (or `interleaved_one_f_one_b(p, l, v)`) compiled once; stage s
    runs the microbatch at position k in ``(scale_s * cost_k + offset_s) / v`` (forward or
    backward cost and offset), so `times` evaluates any microbatch order in O(p * l * v).
    `actions[i]` = (kind, stage, position, chunk), dependencies first."""

    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: tuple[tuple[str, int, int, int], ...]
    recurrence: Recurrence[int]
    scale: tuple[float, ...]  # per action
    offset: tuple[float, ...]

    @classmethod
    def build(cls, num_stages: int, num_microbatches: int, num_chunks: int = 1,
              stage_costs: Sequence[tuple[float, float, float]] | None = None) -> "PipelineModel":
        p, l, v = num_stages, num_microbatches, num_chunks
        check_stages(p, v, l)
        affine = stage_affine(stage_costs, p)
        if l == 0:
            return cls(p, 0, v, (), Recurrence((), (), ()), (), ())
        table = one_f_one_b(p, l) if v == 1 else interleaved_one_f_one_b(p, l, v)
        rec = Recurrence.compile(table, topology(table))
        actions = tuple((a.kind, s, a.microbatch, a.chunk) for s, a in rec.keys)
        scale = tuple(affine[s][0] for _, s, _, _ in actions)
        offset = tuple(affine[s][1 if kind == "F" else 2] for kind, s, _, _ in actions)
        return cls(p, l, v, actions, rec, scale, offset)

    def times(self, fwd_by_pos: Sequence[float], bwd_by_pos: Sequence[float]):
        """(start, end) of every action, with per-position forward/backward costs."""
        v = self.num_chunks
        return self.recurrence.times(
            [(sc * (fwd_by_pos[k] if kind == "F" else bwd_by_pos[k]) + off) / v
             for (kind, _s, k, _c), sc, off in zip(self.actions, self.scale, self.offset)])

    def iteration_time(self, fwd_by_pos: Sequence[float], bwd_by_pos: Sequence[float]) -> float:
        return max(self.times(fwd_by_pos, bwd_by_pos)[1], default=0.0)


def batch_iteration_time(model: PipelineModel, fwd_by_pos: np.ndarray,
                         bwd_by_pos: np.ndarray) -> np.ndarray:
    """`PipelineModel.iteration_time` of many orders at once: fwd/bwd_by_pos [orders, l]
    -> [orders]."""
    fwd = np.ascontiguousarray(np.asarray(fwd_by_pos, dtype=np.float64).T)  # [l, orders]
    bwd = np.ascontiguousarray(np.asarray(bwd_by_pos, dtype=np.float64).T)
    v = model.num_chunks

    def duration(i):
        kind, _s, k, _c = model.actions[i]
        return (model.scale[i] * (fwd[k] if kind == "F" else bwd[k]) + model.offset[i]) / v
    return model.recurrence.batch_end(duration, fwd.shape[1])
