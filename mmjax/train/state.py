"""The pipelined run's training state: one pytree value, owned by the runner that steps it
(train/pipelined.py). Saving, restoring, re-planning and export read and write this value
only; the pipeline runtime reads the compute copies it is handed and keeps none.

The single program's equivalent is train/step.py's `TrainState` (step, trainable, frozen,
optimizer state), which its jitted step takes and returns whole.
"""
from __future__ import annotations

from typing import NamedTuple


class StageState(NamedTuple):
    """One trained stage on its sub-mesh: `master` the float32 parameters and `opt` the
    optimizer state, both as ZeRO-1 shards over the stage's dp ranks (parallel/zero.py);
    `compute` the copy the stage's forward and backward read (compute dtype, replicated over
    dp), made from `master` by the update program's all-gather."""

    master: object
    opt: object
    compute: object


class TrainState(NamedTuple):
    """`stages`: {StageId: StageState} for every trained stage with devices in this process;
    `step`: training steps run; `data`: the loader's position (`Loader.get_state()`), {}
    for a runner fed by hand."""

    stages: dict
    step: int = 0
    data: dict = {}
