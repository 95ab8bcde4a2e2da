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

import enum
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence

KINDS = ("F", "B")


class Backward(str, enum.Enum):
    """What a stage's backward computes (Cornstarch §4.2, frozen-status aware): the schedule
    decides it from the trainable flags, the runtime's stage functions implement it."""

    FULL = "full"              # parameter and input gradients
    PARAMS = "params"          # parameter gradients only: nothing upstream needs dx
    INPUT_ONLY = "input_only"  # input gradients only: a frozen stage, trainable upstream
    NONE = "none"              # no backward at all: nothing trainable at or upstream

    @property
    def param_grads(self) -> bool:
        return self in (Backward.FULL, Backward.PARAMS)

    @property
    def input_grads(self) -> bool:
        return self in (Backward.FULL, Backward.INPUT_ONLY)


BACKWARD_MODES = tuple(m.value for m in Backward)
_ACTION_RE = re.compile(r"^([FB])(\d+)(?:\.(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One forward ("F") or backward ("B") pass of one microbatch through one model chunk."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action.kind={self.kind!r}: must be 'F' or 'B'")
        if not isinstance(self.microbatch, int) or self.microbatch < 0:
            raise ValueError(f"Action.microbatch={self.microbatch!r}: must be an int >= 0")
        if not isinstance(self.chunk, int) or self.chunk < 0:
            raise ValueError(f"Action.chunk={self.chunk!r}: must be an int >= 0")

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Inverse of `str`: "F3" -> Action("F", 3), "B3.1" -> Action("B", 3, 1)."""
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ValueError(f"cannot parse action {text!r}; write it like 'F3' or 'B3.1'")
        return cls(m.group(1), int(m.group(2)), int(m.group(3) or 0))


@dataclass(frozen=True, order=True)
class StageId:
    """Pipeline stage `index` of unit `unit` ("vision", "audio", ..., "llm", "generator")."""

    unit: str
    index: int

    def __str__(self) -> str:
        return f"{self.unit}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> "StageId":
        unit, sep, index = text.rpartition(":")
        if not sep or not unit or not index.isdigit():
            raise ValueError(f"cannot parse stage {text!r}; write it like 'llm:0'")
        return cls(unit, int(index))


def stage_name(stage: Hashable) -> str:
    """The trace name of a stage: "llm:0" for a StageId, "stage:3" for stage 3 of a chain."""
    return str(stage) if isinstance(stage, StageId) else f"stage:{stage}"


# ---------------------------------------------------------------------------------------
# The unit DAG
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageGraph:
    """Stages of all units, the edges between them, and each stage's backward mode.

    `has_backward[s]` is a `Backward` mode (or its string): "full" (param + input grads),
    "params" (a trainable stage with nothing trainable upstream: no input grads needed),
    "input_only" (frozen stage with a trainable stage upstream) or "none" (nothing trainable
    at or before it: no backward at all), Cornstarch §4.2. `stages` is in topological order.

    Interleaved units (Megatron-LM virtual pipeline stages): `chunks[unit] = v > 1` makes
    the unit's `pp * v` stages listed here virtual; virtual stage `k = c * pp + s` is model
    chunk `c` of physical stage `s` (`physical`, `virtual`). Schedules are keyed by
    `physical_stages`. Units absent from `chunks` have one chunk: physical == virtual.
    """

    stages: tuple[StageId, ...]
    edges: tuple[tuple[StageId, StageId], ...]
    has_backward: Mapping[StageId, str] = field(hash=False)
    chunks: Mapping[str, int] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        known = set(self.stages)
        if len(known) != len(self.stages):
            raise ValueError(f"StageGraph.stages has duplicates: {list(map(str, self.stages))}")
        for a, b in self.edges:
            for s in (a, b):
                if s not in known:
                    raise ValueError(f"StageGraph.edges: {s} is not in StageGraph.stages")
        pos = {s: i for i, s in enumerate(self.stages)}
        for a, b in self.edges:
            if pos[a] >= pos[b]:
                raise ValueError(f"StageGraph.edges: {a} -> {b} goes against the order of "
                                 "StageGraph.stages; list stages in topological order")
        if set(self.has_backward) != known:
            missing = [str(s) for s in self.stages if s not in self.has_backward]
            extra = [str(s) for s in self.has_backward if s not in known]
            raise ValueError(f"StageGraph.has_backward must have one entry per stage; "
                             f"missing {missing}, unknown {extra}")
        for s, mode in self.has_backward.items():
            if mode not in BACKWARD_MODES:
                raise ValueError(f"StageGraph.has_backward[{s}]={mode!r}: use one of "
                                 f"{BACKWARD_MODES}")
        for a, b in self.edges:
            if self.has_backward[a] != "none" and self.has_backward[b] == "none":
                raise ValueError(f"StageGraph.has_backward: {a} runs a backward but its "
                                 f"successor {b} runs none, so no gradient can reach {a}; "
                                 f"set {b} to 'input_only' or 'full'")
        count: dict[str, int] = {}
        for st in self.stages:
            count[st.unit] = count.get(st.unit, 0) + 1
        for u, v in self.chunks.items():
            if u not in count:
                raise ValueError(f"StageGraph.chunks names unit {u!r}, which has no stages "
                                 f"(units: {list(count)})")
            if not isinstance(v, int) or v < 1 or count[u] % v:
                raise ValueError(f"StageGraph.chunks[{u!r}]={v!r}: must be an int >= 1 "
                                 f"dividing the unit's {count[u]} virtual stages")
            if {st.index for st in self.stages if st.unit == u} != set(range(count[u])):
                raise ValueError(f"StageGraph: the stages of interleaved unit {u!r} must be "
                                 f"{u}:0 .. {u}:{count[u] - 1} (virtual stage c * pp + s)")

    # ---- structure -------------------------------------------------------------------
    def predecessors(self, stage: StageId) -> list[StageId]:
        return [a for a, b in self.edges if b == stage]

    def successors(self, stage: StageId) -> list[StageId]:
        return [b for a, b in self.edges if a == stage]

    def runs_backward(self, stage: StageId) -> bool:
        return self.has_backward[stage] != "none"

    # ---- virtual stages of interleaved units ----------------------------------------
    def num_chunks(self, unit: str) -> int:
        return self.chunks.get(unit, 1)

    def num_stages(self, unit: str) -> int:
        """Physical pipeline stages (pp) of `unit`: its virtual stages / num_chunks."""
        return sum(st.unit == unit for st in self.stages) // self.num_chunks(unit)

    def physical(self, stage: StageId) -> tuple[StageId, int]:
        """Virtual stage k = c * pp + s of its unit -> (physical stage s, chunk c)."""
        if self.num_chunks(stage.unit) == 1:
            return stage, 0
        pp = self.num_stages(stage.unit)
        return StageId(stage.unit, stage.index % pp), stage.index // pp

    def virtual(self, stage: StageId, chunk: int = 0) -> StageId:
        """(physical stage s, chunk c) -> virtual stage c * pp + s of its unit."""
        if self.num_chunks(stage.unit) == 1:
            return stage
        return StageId(stage.unit, chunk * self.num_stages(stage.unit) + stage.index)

    @property
    def physical_stages(self) -> tuple[StageId, ...]:
        """The stages that own devices, in the order of their first (chunk 0) virtual
        stage; equal to `stages` when no unit is interleaved."""
        return tuple(s for s in self.stages if self.physical(s)[1] == 0)

    def num_downstream(self, stage: StageId) -> int:
        """Stages after `stage` on its path to the sink (longest path, in stages): the
        warm-up depth of Cornstarch Fig. 6 (an encoder stage counts the LLM stages too)."""
        depth: dict[StageId, int] = {}
        for s in reversed(self.stages):
            depth[s] = max((1 + depth[t] for t in self.successors(s)), default=0)
        return depth[stage]

    # ---- constructors ----------------------------------------------------------------
    @classmethod
    def from_units(cls, encoders: Mapping[str, int], llm: int, generator: int = 0,
                   trainable: Mapping[str, bool | Sequence[bool]] | None = None,
                   chunks: Mapping[str, int] | None = None) -> "StageGraph":
        """Encoder branches (name -> stages) each a chain feeding llm stage 0; llm chain;
        the llm's last stage feeds the generator chain (if generator > 0).

        Counts are physical pipeline stages (pp). `chunks[unit] = v` (default 1) makes the
        unit interleaved: its chain has pp * v virtual stages (Megatron-LM's model chunks).
        `trainable[unit]` is a bool, or one bool per (virtual) stage of that unit (e.g. a
        frozen encoder whose last stage holds a trainable projector: `(False, True)`). A
        stage runs backward iff something at or upstream of it is trainable (Cornstarch
        §4.2); "input_only" if it is itself frozen. Omitted `trainable`: all trainable.
        """
        for name in ("llm", "generator"):
            if name in encoders:
                raise ValueError(f"encoders[{name!r}]: {name!r} is not an encoder name")
        if not isinstance(llm, int) or llm < 1:
            raise ValueError(f"llm={llm!r}: the llm needs at least 1 pipeline stage")
        if not isinstance(generator, int) or generator < 0:
            raise ValueError(f"generator={generator!r}: must be an int >= 0 (0 = none)")
        for name, n in encoders.items():
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"encoders[{name!r}]={n!r}: an encoder needs >= 1 stage")
        units = {**encoders, "llm": llm, **({"generator": generator} if generator else {})}
        chunks = dict(chunks or {})
        for u, v in chunks.items():
            if u not in units:
                raise ValueError(f"chunks has unknown unit {u!r}; units are {list(units)}")
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"chunks[{u!r}]={v!r}: must be an int >= 1")
        units = {u: n * chunks.get(u, 1) for u, n in units.items()}  # virtual stages
        trainable = {u: True for u in units} if trainable is None else dict(trainable)
        unknown = sorted(set(trainable) - set(units))
        if unknown:
            raise ValueError(f"trainable has unknown units {unknown}; units are {list(units)}")
        per_stage: dict[StageId, bool] = {}
        for u, n in units.items():
            if u not in trainable:
                raise ValueError(f"trainable has no entry for unit {u!r}; give True/False "
                                 "or one bool per stage")
            flags = trainable[u]
            flags = (flags,) * n if isinstance(flags, bool) else tuple(flags)
            if len(flags) != n or not all(isinstance(f, bool) for f in flags):
                raise ValueError(f"trainable[{u!r}]={trainable[u]!r}: give a bool or {n} "
                                 f"bools (one per {'virtual ' if chunks.get(u, 1) > 1 else ''}"
                                 f"stage of {u!r})")
            per_stage.update({StageId(u, i): f for i, f in enumerate(flags)})

        stages, edges = [], []
        for u, n in units.items():
            chain = [StageId(u, i) for i in range(n)]
            stages += chain
            edges += list(zip(chain[:-1], chain[1:]))
            if u in encoders:
                edges.append((chain[-1], StageId("llm", 0)))
        if generator:
            edges.append((StageId("llm", units["llm"] - 1), StageId("generator", 0)))

        upstream: dict[StageId, bool] = {}  # something trainable strictly before s
        for s in stages:
            preds = [a for a, b in edges if b == s]
            upstream[s] = any(upstream[a] or per_stage[a] for a in preds)
        has_backward = {s: (Backward.FULL if upstream[s] else Backward.PARAMS) if per_stage[s]
                        else Backward.INPUT_ONLY if upstream[s] else Backward.NONE
                        for s in stages}
        return cls(tuple(stages), tuple(edges), has_backward,
                   {u: v for u, v in chunks.items() if v > 1})

    @classmethod
    def from_plan(cls, plan) -> "StageGraph":
        """The unit DAG of a `mmjax.planner.plan.Plan`: every unit other than "llm" and
        "generator" is an encoder branch; a unit is trainable iff not `frozen`; a unit
        with num_chunks > 1 is interleaved (pp * num_chunks virtual stages)."""
        names = plan.unit_names
        if "llm" not in names:
            raise ValueError(f"plan has no 'llm' unit (units: {list(names)})")
        enc = {u.name: u.pp for u in plan.units if u.name not in ("llm", "generator")}
        gen = plan.unit("generator").pp if "generator" in names else 0
        return cls.from_units(enc, plan.unit("llm").pp, gen,
                              {u.name: not u.frozen for u in plan.units},
                              {u.name: u.num_chunks for u in plan.units})


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------
def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}: must be an int >= 1")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches={num_microbatches!r}: must be an int >= 1")


def _warmup_steady_cooldown(num_warmup: int, num_microbatches: int) -> list[Action]:
    """1F1B on one stage (the distributed-training lecture notes, Megatron-LM): `num_warmup` forwards, then alternate
    one forward and one backward, then drain the remaining backwards."""
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
    """Megatron-LM's non-interleaved 1F1B (the distributed-training lecture notes): stage s warms up with
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
        _, end, pos = _run(out, topo, lambda s, a: 1.0)
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


# ---------------------------------------------------------------------------------------
# Dependencies, execution and validation
# ---------------------------------------------------------------------------------------
Key = tuple[Hashable, Action]  # (stage, action)


@dataclass(frozen=True)
class Topology:
    """A schedule's stages, chunks per stage, and its nodes (stage, chunk): their backward
    modes and the nodes that feed each other. Built by `topology`; shared by `validate`,
    `dispatch_order` and `simulate`."""

    stages: tuple[Hashable, ...]
    chunks: Mapping[Hashable, int]
    has_backward: Mapping[tuple[Hashable, int], str]
    preds: Mapping[tuple[Hashable, int], tuple[tuple[Hashable, int], ...]]
    succs: Mapping[tuple[Hashable, int], tuple[tuple[Hashable, int], ...]]

    _deps: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_chunks(self) -> int:
        return max(self.chunks.values(), default=1)

    def runs_backward(self, stage: Hashable, chunk: int = 0) -> bool:
        return self.has_backward[(stage, chunk)] != "none"

    def dependencies(self, stage: Hashable, action: Action) -> list[Key]:
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
                    if self.has_backward[(s, c)] != "none"]
            self._deps[key] = deps
        return deps


def topology(schedule, graph: StageGraph | None = None) -> Topology:
    """List schedule: a chain of len(schedule) stages, chunks inferred from the actions
    (virtual stage c * p + s), every stage runs a full backward. Dict schedule: keyed by
    the physical stages of `graph` (required); node (stage s, chunk c) is the unit's
    virtual stage c * pp + s, with the graph's edges and backward modes."""
    if isinstance(schedule, Mapping):
        if graph is None:
            raise ValueError("a schedule keyed by StageId needs graph=StageGraph(...) "
                             "to know its edges and backward modes")
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
    if not isinstance(schedule, Sequence) or isinstance(schedule, str):
        raise ValueError(f"schedule must be a list of per-stage action lists or a dict "
                         f"keyed by StageId, got {type(schedule).__name__}")
    if graph is not None:
        raise ValueError("graph= is only for dict schedules keyed by StageId; a list "
                         "schedule is a plain chain of stages")
    p = len(schedule)
    if p == 0:
        raise ValueError("schedule has no stages")
    v = 1 + max((a.chunk for row in schedule for a in row if isinstance(a, Action)),
                default=0)
    virtual = [(s, c) for c in range(v) for s in range(p)]  # virtual stage c * p + s
    preds = {n: () for n in virtual}
    succs = {n: () for n in virtual}
    for a, b in zip(virtual[:-1], virtual[1:]):
        preds[b] = (a,)
        succs[a] = (b,)
    return Topology(tuple(range(p)), {s: v for s in range(p)},
                    {n: Backward.FULL for n in virtual}, preds, succs)


def _run(schedule, topo: Topology, duration: Callable[[Hashable, Action], float],
         comm: float = 0.0) -> tuple[dict[Key, float], dict[Key, float], dict]:
    """Event loop of `execute`; returns (start, end, position reached in each row)."""
    start: dict[Key, float] = {}
    end: dict[Key, float] = {}
    pos = {s: 0 for s in topo.stages}
    free = {s: 0.0 for s in topo.stages}
    waiting: dict[Key, list] = {}
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


def execute(schedule, topo: Topology, duration: Callable[[Hashable, Action], float],
            comm: float = 0.0) -> tuple[dict[Key, float], dict[Key, float], list[str]]:
    """Run every stage's actions in order: an action starts when its stage is free and
    its dependencies have ended (+ `comm` when the dependency is on another stage).
    Returns (start, end, stuck); `stuck` describes each stage that could not finish
    (a deadlock), empty when the schedule runs to completion."""
    start, end, pos = _run(schedule, topo, duration, comm)
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
