"""The planner's pick: the closed-form search proposes, the simulated schedule decides
(no JAX).

The search (orchestrate.py) minimises DistTrain's closed form (Eq. 1-2), which a convex
relaxation can bound; what runs, and what the planner reports, is the 1F1B schedule
(schedule_time.py). The closed form is neither the schedule's time nor a bound of it (it
sums parallel branches' and pipelined units' warm-ups the schedule overlaps, and leaves
out the per-hop transfers and interleaving bubbles the schedule pays), so
`pick_by_schedule` ranks the candidates -- the search's frontier (every repaired plan on a
(GPUs, closed-form time) Pareto front) and the baselines' plans -- by a lower bound of the
schedule's time (schedule_bound.py) and times them in that order until the bound exceeds
the best time found: the pick is the fastest plan among all the candidates by the
schedule, within memory by the one memory count (evaluate.runtime_memory). Tie-break:
among plans within `gpu_tolerance` of the least time, and no slower than any baseline,
the one using the fewest GPUs, then the fastest.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, cast

import numpy as np

from mmjax.models.units import UnitDag
from mmjax.planner.evaluate import Choice, runtime_memory
from mmjax.planner.hardware import Hardware
from mmjax.planner.schedule_time import ScheduleTimer

if TYPE_CHECKING:
    from mmjax.planner.frontier import Frontier

MAX_TIMED = 2000  # a guard: plans timed at most (the bound stops far earlier in practice)


@dataclass(frozen=True)
class Proposal:
    """One candidate plan: a lower bound of its schedule's time, the costs it is priced
    with (the LLM's depend on its CP size), its choices (or a function building them:
    a large frontier builds only the plans it times) and where it came from ("search" or
    a baseline's name)."""

    lower_bound_s: float
    costs: tuple
    plan: dict[str, Choice] | Callable[[], dict[str, Choice]] = field(hash=False)
    source: str = "search"
    cp: int = 1

    @property
    def choices(self) -> dict[str, Choice]:
        return self.plan() if callable(self.plan) else self.plan


class Proposals:
    """Candidates for `pick_by_schedule` in parts: lists of `Proposal`s and search
    frontiers, each frontier plan a `Proposal` only when read (a 72B search proposes
    thousands; the pick reads the tens it times). `bounds`: every candidate's lower bound,
    in order; `fits`: False where a frontier plan is known not to fit in memory."""

    def __init__(self, parts):
        self._parts, self._starts, bounds, fits, start = [], [], [], [], 0
        for part in parts:
            if isinstance(part, FrontierProposals):
                bounds.append(part.bounds)
                fits.append(part.fits)
            else:
                part = list(part)
                bounds.append(np.array([p.lower_bound_s for p in part], dtype=np.float64))
                fits.append(np.ones(len(part), dtype=bool))
            self._parts.append(part)
            self._starts.append(start)
            start += len(part)
        self.bounds = np.concatenate(bounds) if bounds else np.zeros(0)
        self.fits = np.concatenate(fits) if fits else np.zeros(0, dtype=bool)

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, i: int) -> Proposal:
        j = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self._parts[j][i - self._starts[j]]


@dataclass(frozen=True)
class FrontierProposals:
    """The search's frontier at one CP size (frontier.py `Frontier`, rank order) with each
    plan's schedule lower bound and whether it fits by the runtime's memory count
    (`Frontier.fits`): plan k as a `Proposal` on reading."""

    bounds: np.ndarray
    costs: tuple
    frontier: Frontier
    cp: int = 1
    fits: np.ndarray | None = None

    def __post_init__(self):
        if self.fits is None:
            object.__setattr__(self, "fits", np.ones(len(self.bounds), dtype=bool))

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, k: int) -> Proposal:
        return Proposal(float(self.bounds[k]), self.costs,
                        functools.partial(self.frontier.choices, k), "search", self.cp)


@dataclass(frozen=True)
class Pick:
    proposal: Proposal
    choices: dict[str, Choice]
    time_s: float  # the pick's simulated time
    least_time_s: float  # the least simulated time of any candidate that fits
    timed: int  # candidates timed
    over_memory: int  # candidates left out: over memory by the runtime's count
    candidates: int


def pick_by_schedule(proposals: "list[Proposal] | Proposals", global_batch: int, hw: Hardware,
                     gpu_tolerance: float, timer: ScheduleTimer | None = None) -> Pick | None:
    """The fastest plan by the simulated schedule among `proposals` that fits in memory
    (with the tie-break above); None when none fits."""
    timer = timer or ScheduleTimer(hw)
    bounds = getattr(proposals, "bounds", None)
    if bounds is None:
        # no bounds: a plain list (FrontierProposals always has them)
        bounds = np.array([p.lower_bound_s for p in cast("list[Proposal]", proposals)],
                          dtype=np.float64)
    known = getattr(proposals, "fits", None)  # False: over memory, known without building
    order = np.argsort(bounds, kind="stable")  # by bound; a tie keeps the given order
    dag = None  # the units' DAG, the same for every proposal (one model)
    timed: list[tuple[float, Proposal, dict]] = []
    over, best, fastest_baseline = 0, float("inf"), float("inf")
    for i in order:
        p = proposals[int(i)]
        cap = min(best * (1 + gpu_tolerance), fastest_baseline)
        if p.lower_bound_s > cap * (1 + 1e-9) or len(timed) >= MAX_TIMED:
            break
        if known is not None and not known[int(i)]:
            over += 1
            continue
        choices = p.choices
        dag = dag or UnitDag.of(choices)
        ran, need = runtime_memory(p.costs, choices, global_batch, hw, dag)
        if any(b > hw.hbm_bytes for b in need.values()):
            over += 1
            continue
        # a plan slower than the cap is never picked (the cap only falls): its timing
        # stops once it is past the cap (a margin above it for the sync's rounding)
        t = timer(ran, choices, global_batch, ran=True, limit=cap * (1 + 1e-6))
        timed.append((t, p, choices))
        best = min(best, t)
        if p.source != "search":
            fastest_baseline = min(fastest_baseline, t)
    if not timed:
        return None
    cap = min(best * (1 + gpu_tolerance), fastest_baseline)
    gpus = lambda ch: sum(c.gpus for c in ch.values())  # noqa: E731
    t, p, ch = min((x for x in timed if x[0] <= cap), key=lambda x: (gpus(x[2]), x[0]))
    return Pick(p, ch, t, best, len(timed), over, len(proposals))
