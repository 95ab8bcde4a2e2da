"""Peak device memory of the co-located step (train/colocated.py), term by term (no JAX).

One jitted SPMD program runs every unit on every device; at its peak (the LLM's and the
encoders' backward) one device holds, per unit u at ZeRO stage z, dp_u ranks, P trainable
and F frozen parameters (one tp rank's share), s_u samples per device at the shapes the
runner pads to (`BatchShapes` rounded to the device count, or the per-phase shapes the
loader scans):

- `params`: float32 parameters and frozen weights, 4 (P + F), / dp at z = 3;
- `optimizer`: AdamW's m and v, 8 P / dp (every stage);
- `copy`: the step's compute-dtype copy of the parameters, b (P + F) at z = 1-2 below
  float32 (none in float32; at z = 3 each gathered layer is cast on its own);
- `gradients`: the float32 gradients the backward builds: whole (4 P) at z = 1-2 (XLA
  forms each one whole before the all-reduce / reduce-scatter), 4 P / dp at z = 3 (each
  layer's gradient reduce-scattered inside the layer scan);
- `gathered` (z = 3): the layer the scan gathered, float32, in the forward and again in
  the backward, and its whole gradient: 3 layers' weights of the unit whose backward sets
  the peak (the one with the largest `work`; the other units' layers are not live then);
- `residuals`: what each unit keeps for its backward under the scan's "dots" policy (the
  runner's layers run under it: models/scan.py), s_u (dots + input + output cotangent):
  the encoders' stay live through the LLM's backward (their backward runs last);
- `inputs`: the unit's batch arrays per device (token ids, positions, masks, patches or
  frames, latents), `UnitLoad.input_bytes` per sample;
- `work`: the largest backward working set: one layer's residuals rebuilt
  ((none - dots) / layers per sample, planner/memory.py's per-module counts, which hold
  the dense attention path's float32 logits, probabilities and masks and a tiled path's
  row statistics only: `Acts` at the implementation that runs), plus the cotangent of the
  probabilities (one score buffer; none on a tiled path) while its attention's backward
  runs;
- `exchange` (per-phase balancing): each encoder's all-to-all send and receive buffers,
  2 x devices x capacity rows (train/memory_check.py `check_colocated`).

Checked against the compiled step's `memory_analysis()` (argument + temporary bytes per
device) for ZeRO 1, 2 and 3 on the tiny config (tests/test_colocated_memory_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.planner.memory import (ADAM_BYTES, F32, FROZEN_BYTES, GATHERED_BACKWARD,
                                  GATHERED_FORWARD, Acts, zero_divisors)

# one program: the forward's gathered layer stays live through the backward's gather and
# the layer's whole gradient (a pipeline stage's separate programs hold one or the other)
GATHERED_LAYERS = GATHERED_FORWARD + GATHERED_BACKWARD


@dataclass(frozen=True)
class UnitLoad:
    """One unit on one device: parameters (one tp rank's share), its largest layer's
    parameters, ZeRO stage, data-parallel ranks, samples per device and their activations
    (`Acts` of one sample at the padded shapes)."""

    name: str
    trainable: float
    frozen: float
    layer: float
    layers: int
    stage: int
    dp: int
    samples: float
    acts: Acts
    input_bytes: float = 0.0  # the batch arrays of one sample
    compute_bytes: int = F32  # the compute dtype's bytes


@dataclass(frozen=True)
class ColocatedMemory:
    """Bytes per device of the co-located step (module docstring)."""

    params: float
    optimizer: float
    copy: float  # the compute-dtype copy of the parameters (stages 1-2, below float32)
    gradients: float
    gathered: float
    residuals: float
    work: float
    inputs: float = 0.0
    exchange: float = 0.0  # the encoder->LLM all-to-alls' send and receive buffers

    @property
    def state(self) -> float:
        """The step's arguments: parameters and optimizer state as held between steps."""
        return self.params + self.optimizer

    @property
    def peak(self) -> float:
        return (self.params + self.optimizer + self.copy + self.inputs + self.gradients + self.gathered
                + self.residuals + self.work + self.exchange)


def colocated_memory(units: list[UnitLoad]) -> ColocatedMemory:
    """Sum the terms over `units` (module docstring)."""
    params = opt = copy = grads = gathered = kept = work = inputs = 0.0
    for u in units:
        z3 = u.stage == 3 and u.dp > 1
        _, w = zero_divisors(u.stage, u.dp)  # the weights' divisor: dp at stage 3
        params += (F32 * u.trainable + FROZEN_BYTES * u.frozen) / w
        opt += ADAM_BYTES * u.trainable / u.dp
        if u.compute_bytes < F32 and u.stage < 3:  # at 3 the gathered layer is cast alone
            copy += u.compute_bytes * (u.trainable + u.frozen)
        grads += F32 * u.trainable / w  # stage 2 forms them whole before reduce-scattering
        a = u.acts
        inputs += u.samples * u.input_bytes
        kept += u.samples * (a.dots + a.input + a.boundary)
        layers = max(u.layers, 1)
        w = u.samples * ((a.none - a.dots) / layers + a.scores)
        if w > work:  # the peak: this unit's backward, its own gathered layer live
            work, gathered = w, GATHERED_LAYERS * F32 * u.layer if z3 else 0.0
    return ColocatedMemory(params, opt, copy, grads, gathered, kept, work, inputs)
