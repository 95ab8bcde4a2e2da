"""The planner's pick: the closed-form search proposes, the simulated schedule decides
(no JAX).

The search (orchestrate.py) minimises DistTrain's closed form (Eq. 1-2), which a convex
relaxation can bound; what runs, and what the planner reports, is the 1F1B schedule
(schedule_time.py). `pick_by_schedule` times the search's frontier (every repaired plan
on a (GPUs, closed-form time) Pareto front) and the baselines' plans with the schedule,
least closed-form time first, and keeps the fastest that fits in memory by the one
memory count (evaluate.runtime_memory). The closed form is nearly a lower bound of the
schedule's time (it leaves out the per-hop transfers and interleaving bubbles the
schedule pays; it sums parallel encoder branches' warm-ups, so it may exceed the schedule
by a little): proposals stop once their closed form exceeds the best simulated time by
`LOWER_BOUND_SLACK`, or after `MAX_TIMED` of them. Tie-break: among plans within
`gpu_tolerance` of the least simulated time, and no slower than any baseline, the one
using the fewest GPUs, then the fastest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mmjax.planner.evaluate import Choice, runtime_memory
from mmjax.planner.hardware import Hardware
from mmjax.planner.schedule_time import ScheduleTimer

# The closed form exceeds the schedule's time by at most ~1.3% on the DistTrain and
# OrchMLLM models (parallel branches' warm-ups summed); proposals whose closed form is
# this far above the best simulated time are not timed.
LOWER_BOUND_SLACK = 0.02
MAX_TIMED = 400  # proposals timed at most, baselines aside


@dataclass(frozen=True)
class Proposal:
    """One plan to time: its closed-form time, the costs it is priced with (the LLM's
    depend on its CP size), its choices and where it came from ("search" or a baseline)."""

    closed_form_s: float
    costs: tuple
    choices: dict[str, Choice] = field(hash=False)
    source: str = "search"
    cp: int = 1


@dataclass(frozen=True)
class Pick:
    proposal: Proposal
    time_s: float  # the pick's simulated time
    least_time_s: float  # the least simulated time of any plan that fits
    timed: int  # plans timed
    over_memory: int  # proposals left out: over memory by the runtime's count


def pick_by_schedule(searched, baselines: list[Proposal], global_batch: int, hw: Hardware,
                     gpu_tolerance: float, timer: ScheduleTimer | None = None) -> Pick | None:
    """The fastest plan by the simulated schedule among `baselines` and the proposals of
    `searched` (an iterable of Proposals, least closed form first), within memory; None
    when none fits."""
    timer = timer or ScheduleTimer(hw)
    timed: list[tuple[float, Proposal]] = []
    over, best = 0, float("inf")

    def time_one(p: Proposal) -> None:
        nonlocal over, best
        ran, need = runtime_memory(p.costs, p.choices, global_batch, hw)
        if any(b > hw.hbm_bytes for b in need.values()):
            over += 1
            return
        timed.append((timer(ran, p.choices, global_batch, ran=True), p))
        best = min(best, timed[-1][0])

    for p in baselines:
        time_one(p)
    count = 0
    for p in searched:
        if p.closed_form_s > best * (1 + LOWER_BOUND_SLACK) or count >= MAX_TIMED:
            break
        time_one(p)
        count += 1
    if not timed:
        return None
    least = min(t for t, _ in timed)
    cap = least * (1 + gpu_tolerance)
    base = [t for t, p in timed if p.source != "search"]
    if base:
        cap = min(cap, min(base))
    gpus = lambda p: sum(c.gpus for c in p.choices.values())  # noqa: E731
    t, pick = min(((t, p) for t, p in timed if t <= cap), key=lambda tp: (gpus(tp[1]), tp[0]))
    return Pick(pick, t, least, len(timed), over)
