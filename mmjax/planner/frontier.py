"""The plans a closed-form search proposes (orchestrate.py), as columns (no JAX).

Every point of every repaired neighbourhood's (GPUs, closed-form time) Pareto front, least
closed-form time first; a plan's choices are built only when read (a 72B search proposes
thousands, the pick reads tens), and the pick's lower bounds and memory verdicts are
computed for all of them at once from each option table's per-option columns.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

from mmjax.models.units import UnitDag
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import Choice
from mmjax.planner.frontier_memory import fits_by_runtime
from mmjax.planner.hardware import Hardware
from mmjax.planner.schedule_bound import chain_bound

class Proposer(Protocol):
    """What a frontier reads of its search (orchestrate.py `Orchestrator`): the units'
    costs and a plan's choices from its picked option tables."""
    @property
    def costs(self) -> tuple[UnitCost, ...]: ...

    def _choices(self, picked, idx) -> dict[str, Choice]: ...


class Frontier:
    """The plans the search proposes: every point of every repaired neighbourhood's
    (GPUs, closed-form time) Pareto front, least closed-form time first. `choices(k)`
    builds the k-th plan (lazily: a 72B search proposes thousands)."""

    def __init__(self, orchestrator: Proposer, fronts: list):
        self.times = np.concatenate([f[1] for f in fronts]) if fronts else np.zeros(0)
        self.gpus = np.concatenate([f[0] for f in fronts]) if fronts else np.zeros(0)
        self.order = np.argsort(self.times, kind="stable")
        # per plan, its front and its flat index in that front's neighbourhood
        self._front = (np.repeat(np.arange(len(fronts)), [len(f[2]) for f in fronts])
                       if fronts else np.zeros(0, dtype=int))
        self._flat = np.concatenate([f[2] for f in fronts]) if fronts else np.zeros(0, int)
        self._fronts, self._orch = fronts, orchestrator
        self._cols: dict | None = None  # `_columns`, built on first use

    def __len__(self) -> int:
        return len(self.order)

    def choices(self, k: int) -> dict[str, Choice]:
        """The plan of rank k (0: least closed-form time)."""
        i = int(self.order[k])
        f, flat = int(self._front[i]), int(self._flat[i])
        _, _, _, shape, picked = self._fronts[f]
        idx = []  # np.unravel_index(flat, shape), in integers
        for size in reversed(shape):
            flat, r = divmod(flat, size)
            idx.append(r)
        return self._orch._choices(picked, idx[::-1])

    def time(self, k: int) -> float:
        return float(self.times[self.order[k]])

    def _columns(self) -> dict:
        """Per unit, `OptionTable.per_option`'s 13 arrays at every plan of the frontier (in
        front order): each table's arrays built once and indexed at once."""
        if self._cols is not None:
            return self._cols
        names = [c.name for c in self._orch.costs]
        tables: list[dict] = [{} for _ in names]  # per unit: id(table) -> (table, base)
        sizes = [0] * len(names)
        where: list[list] = [[] for _ in names]  # per unit, per front: indices into all
        for _gs, _ts, flats, shape, picked in self._fronts:
            idx = np.unravel_index(flats, shape)
            for u, ((tb, flat), ix) in enumerate(zip(picked, idx)):
                if id(tb) not in tables[u]:
                    tables[u][id(tb)] = (tb, sizes[u])
                    sizes[u] += tb.ok.size
                where[u].append(flat[ix] + tables[u][id(tb)][1])
        self._cols = {}
        for u, name in enumerate(names):
            every = [tb.per_option() for tb, _ in tables[u].values()]
            at = np.concatenate(where[u])
            self._cols[name] = tuple(np.concatenate(col)[at] for col in zip(*every))
        return self._cols

    def fits(self, global_batch: int, hw: Hardware) -> np.ndarray:
        """Per plan (in rank order), whether it fits by the runtime's memory count
        (frontier_memory.py: `evaluate.runtime_memory` over the whole frontier)."""
        if not self._fronts:
            return np.zeros(0, dtype=bool)
        opts = {u: cols[:5] for u, cols in self._columns().items()}
        return fits_by_runtime(self._orch.costs, opts, global_batch, hw)[self.order]

    def lower_bounds(self) -> np.ndarray:
        """Per plan (in rank order), a lower bound of its simulated schedule's time
        (pick.py `schedule_lower_bound`, vectorised over the whole frontier)."""
        if not self._fronts:
            return np.zeros(0)
        rows = {u: cols[5:] for u, cols in self._columns().items()}
        return chain_bound(UnitDag.of(list(rows)), rows)[self.order]
