"""The loss-spike guard: a step whose loss or gradient norm exceeds `factor` times its
running median (over the last `window` applied steps) is not applied. It holds from the
first step: before any step is applied the limits are absolute (`ABSOLUTE_LIMITS`: no
cross-entropy or diffusion loss of a working model comes near them), and until half the
window is filled they are `factor` times the largest value applied so far (a median of one
or two early, fast-falling values would be too tight). A finite 1e22 loss at step 1 or 5
is held back like one at step 500.

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


ABSOLUTE_LIMITS = (1e6, 1e8)  # (loss, gradient norm): above either, never applied


class SpikeGuard:
    def __init__(self, factor: float, window: int):
        self.factor, self.window = float(factor), int(window)
        self.history: deque = deque(maxlen=self.window)

    def limits(self) -> tuple[float, float]:
        """(max loss, max gradient norm) for the next step; (inf, inf) while the guard is
        off (factor 0)."""
        if not self.factor:
            return (math.inf, math.inf)
        if not self.history:
            return ABSOLUTE_LIMITS
        basis = median if len(self.history) >= max(2, self.window // 2) else max
        return tuple(min(bound, self.factor * basis(h[i] for h in self.history))
                     for i, bound in enumerate(ABSOLUTE_LIMITS))

    def basis(self) -> str:
        """What the limits are now, in words."""
        if not self.history:
            return "the absolute limits"
        if len(self.history) >= max(2, self.window // 2):
            return f"{self.factor:g} x their running medians"
        return f"{self.factor:g} x their largest values so far"

    def add(self, loss: float, grad_norm: float) -> None:
        """An applied step's values."""
        self.history.append((float(loss), float(grad_norm)))

    def describe(self, loss: float, grad_norm: float) -> str:
        lim = self.limits()
        return (f"loss {loss:.4g} (limit {lim[0]:.4g}), grad_norm {grad_norm:.4g} "
                f"(limit {lim[1]:.4g}): {self.basis()}")

    def state(self) -> list:
        return [list(h) for h in self.history]

    def restore(self, state) -> None:
        self.history.clear()
        for loss, norm in state:
            self.history.append((float(loss), float(norm)))
