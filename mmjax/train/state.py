"""The training state of a run: one pytree value, owned by the runner that steps it
(train/whole_model.py, train/pipelined.py). Saving, restoring, re-planning and export
read and write this value only; the pipeline runtime reads the compute copies it is
handed and keeps none. Frozen parameters are not training state: they are the runners'
fixed inputs (rebuilt from the seed or the pretrained files, never checkpointed).
"""
from __future__ import annotations

from typing import Any, NamedTuple

WHOLE_MODEL = "model"  # the single program's one stage: the whole model's trainable part


class StageState(NamedTuple):
    """One trained stage. Pipelined: `master` the float32 parameters and `opt` the optimizer
    state, both as ZeRO-1 shards over the stage's dp ranks (parallel/zero.py); `compute`
    the copy the stage's forward and backward read (compute dtype, replicated over dp),
    made from `master` by the update program's all-gather. Single program: `master` and
    `opt` whole (or as the co-located layout shards them), `compute` None (the step casts
    the master inside the loss, so gradients flow back to it)."""

    master: object
    opt: object
    compute: object = None


class TrainState(NamedTuple):
    """`stages`: {StageId: StageState} for every trained stage with devices in this process
    ({WHOLE_MODEL: StageState} in the single program); `step`: training steps run (the
    single program's counts applied steps, on device); `data`: the loader's position, {}
    for a runner fed by hand and inside a jitted step (host JSON, not arrays)."""

    stages: dict
    step: Any = 0  # an int (pipelined), a device scalar (the whole-model step's)
    data: dict = {}


def whole_model_state(trainable, opt_state, step=0) -> TrainState:
    """The single program's TrainState: one stage, the whole model's trainable parameters
    and their optimizer state; no loader position (the runner adds it)."""
    return TrainState({WHOLE_MODEL: StageState(trainable, opt_state)}, step)
