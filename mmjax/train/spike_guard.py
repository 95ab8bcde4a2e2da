"""The loss-spike guard: a step whose loss or gradient norm exceeds `factor` times its
running median (over the last `window` applied steps) is not applied.

Non-finite values are caught by the step itself; a finite spike (a loss of 1e22 after a
bad batch, an exploding gradient) would still move the parameters far. The limits go into
the step as two scalars (`limits()`), so the decision is taken on device before the update,
like the non-finite guard's. The history is part of the checkpoint's data state, so a
resumed run holds back exactly the steps the uninterrupted one does.
"""
from __future__ import annotations

import math
from collections import deque
from statistics import median


class SpikeGuard:
    def __init__(self, factor: float, window: int):
        self.factor, self.window = float(factor), int(window)
        self.history: deque = deque(maxlen=self.window)

    def limits(self) -> tuple[float, float]:
        """(max loss, max gradient norm) for the next step; (inf, inf) while the guard is
        off or fewer than half the window's steps were applied."""
        if not self.factor or len(self.history) < max(2, self.window // 2):
            return (math.inf, math.inf)
        return (self.factor * median(h[0] for h in self.history),
                self.factor * median(h[1] for h in self.history))

    def add(self, loss: float, grad_norm: float) -> None:
        """An applied step's values."""
        self.history.append((float(loss), float(grad_norm)))

    def describe(self, loss: float, grad_norm: float) -> str:
        lim = self.limits()
        return (f"loss {loss:.4g} (limit {lim[0]:.4g}), grad_norm {grad_norm:.4g} "
                f"(limit {lim[1]:.4g}) = {self.factor:g} x their running medians")

    def state(self) -> list:
        return [list(h) for h in self.history]

    def restore(self, state) -> None:
        self.history.clear()
        for loss, norm in state:
            self.history.append((float(loss), float(norm)))
