"""The vocabulary of pipeline schedules (no JAX): an `Action` (forward or backward of one
microbatch through one model chunk), a `StageId` (stage `index` of a unit), the `Backward`
mode of a stage (Cornstarch §4.2, frozen-status aware), and the `StageGraph`: the model's
`UnitDag` (encoder branches in parallel -> LLM -> generator, Cornstarch §4.1 modality
parallelism, Fig. 6) with each unit expanded into its chain of stages, and each stage's
backward mode. Schedules over it: schedule.py; their dependencies and checks:
dependencies.py.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

from mmjax.models.units import GENERATOR_UNIT, LLM_UNIT, UnitDag, is_encoder

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
    has_backward: Mapping[StageId, Backward] = field(hash=False)
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
        # a mode given as its string is held as the enum, so readers compare members
        object.__setattr__(self, "has_backward",
                           {s: Backward(m) for s, m in self.has_backward.items()})
        for a, b in self.edges:
            if self.runs_backward(a) and not self.runs_backward(b):
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
        return self.has_backward[stage] is not Backward.NONE

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
    def from_dag(cls, dag: UnitDag, pp: Mapping[str, int],
                 trainable: Mapping[str, bool | Sequence[bool]] | None = None,
                 chunks: Mapping[str, int] | None = None) -> "StageGraph":
        """Each unit of `dag` a chain of `pp[unit]` physical stages; each unit edge
        (a, b) an edge from a's last stage to b's first.

        `chunks[unit] = v` (default 1) makes the unit interleaved: its chain has pp * v
        virtual stages (Megatron-LM's model chunks). `trainable[unit]` is a bool, or one
        bool per (virtual) stage of that unit (e.g. a frozen encoder whose last stage holds
        a trainable projector: `(False, True)`). A stage runs backward iff something at or
        upstream of it is trainable (Cornstarch §4.2); "input_only" if it is itself frozen.
        Omitted `trainable`: all trainable.
        """
        units = _unit_stages(dag, pp, chunks)
        per_stage = _stage_flags(units, trainable, chunks or {})
        stages, edges = [], []
        link = lambda a, b: (StageId(a, units[a] - 1), StageId(b, 0))  # noqa: E731
        for u, n in units.items():
            chain = [StageId(u, i) for i in range(n)]
            stages += chain
            edges += list(zip(chain[:-1], chain[1:]))
            # a branch's link right after its chain, the LLM's at the end: the edge order
            # (which breaks dispatch ties) the runtime has always seen
            if is_encoder(u):
                edges += [link(u, b) for b in dag.successors(u)]
        edges += [link(a, b) for a, b in dag.edges if not is_encoder(a)]
        has_backward = _backward_modes(stages, edges, per_stage)
        return cls(tuple(stages), tuple(edges), has_backward,
                   {u: v for u, v in (chunks or {}).items() if v > 1})

    @classmethod
    def from_units(cls, encoders: Mapping[str, int], llm: int, generator: int = 0,
                   trainable: Mapping[str, bool | Sequence[bool]] | None = None,
                   chunks: Mapping[str, int] | None = None) -> "StageGraph":
        """`from_dag` with the stage counts given per role: encoder branches (name ->
        stages), the llm's, the generator's (0: none)."""
        for name in encoders:
            if not is_encoder(name):
                raise ValueError(f"encoders[{name!r}]: {name!r} is not an encoder name")
        if not isinstance(llm, int) or llm < 1:
            raise ValueError(f"llm={llm!r}: the llm needs at least 1 pipeline stage")
        if not isinstance(generator, int) or generator < 0:
            raise ValueError(f"generator={generator!r}: must be an int >= 0 (0 = none)")
        pp = {**encoders, LLM_UNIT: llm, **({GENERATOR_UNIT: generator} if generator else {})}
        dag = UnitDag.of(pp)
        return cls.from_dag(dag, pp, trainable, chunks)

    @classmethod
    def from_plan(cls, plan) -> "StageGraph":
        """The `UnitDag` of a `mmjax.planner.plan.Plan`'s units: a unit is trainable iff
        not `frozen`; a unit with num_chunks > 1 is interleaved (pp * num_chunks virtual
        stages). Raises ValueError if the plan has no LLM."""
        return cls.from_dag(UnitDag.of(plan.unit_names), {u.name: u.pp for u in plan.units},
                            {u.name: not u.frozen for u in plan.units},
                            {u.name: u.num_chunks for u in plan.units})


def _unit_stages(dag: UnitDag, pp: Mapping[str, int],
                 chunks: Mapping[str, int] | None) -> dict[str, int]:
    """Unit -> number of virtual stages (pp * chunks), in the DAG's order, after checking
    the counts `StageGraph.from_dag` takes."""
    for name in dag.names:
        n = pp.get(name)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"pp[{name!r}]={n!r}: unit {name!r} needs at least 1 pipeline "
                             "stage")
    extra = sorted(set(pp) - set(dag.names))
    if extra:
        raise ValueError(f"pp has unknown units {extra}; units are {list(dag.names)}")
    for u, v in (chunks or {}).items():
        if u not in dag.names:
            raise ValueError(f"chunks has unknown unit {u!r}; units are {list(dag.names)}")
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"chunks[{u!r}]={v!r}: must be an int >= 1")
    return {u: pp[u] * (chunks or {}).get(u, 1) for u in dag.names}


def _stage_flags(units: dict[str, int], trainable, chunks: Mapping[str, int]
                 ) -> dict[StageId, bool]:
    """Each virtual stage's trainable flag from `trainable[unit]` (one bool, or one per
    stage; omitted: everything trainable)."""
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
    return per_stage


def _backward_modes(stages: list[StageId], edges: list, per_stage: dict[StageId, bool]
                    ) -> dict[StageId, Backward]:
    """Cornstarch §4.2: a stage runs backward iff something at or upstream of it is
    trainable; params only when nothing upstream needs dx; input only when it is frozen."""
    upstream: dict[StageId, bool] = {}  # something trainable strictly before s
    for s in stages:  # stages are in topological order
        upstream[s] = any(upstream[a] or per_stage[a] for a, b in edges if b == s)
    return {s: (Backward.FULL if upstream[s] else Backward.PARAMS) if per_stage[s]
            else Backward.INPUT_ONLY if upstream[s] else Backward.NONE for s in stages}
