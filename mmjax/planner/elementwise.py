"""The memory-bound elementwise passes of a unit's layers (no JAX): norms, residual adds,
RoPE, the MLP's activation, biases - what the FLOP count leaves out and a narrow layer
spends much of its time on (docs/results.md: a 64-wide tiny step on a CPU).

Each activation tensor a layer keeps for its backward (`Work.act_bytes`: the per-token count
10 d + 3 f of the LLM's layer, 10 d + 2 f of an encoder's, the DiT block's) is one tensor an
elementwise kernel writes. Memory accesses to it, in the step's activation dtype:
- forward: written once, read once by the next kernel (2);
- backward, when the unit has one: the saved value read, its cotangent written and read (3);
- per-layer recomputation ("dots" / "full") writes and reads the forward again (2).
Seconds = accesses x bytes / the device's measured streaming bandwidth (`hw.hbm_bw`). The
LM head's logits are left out here (`step_model.HEAD_BYTES_PER_LOGIT` prices them) and so is
dense attention's [S, S] traffic (the measured time per pair has it).
"""
from __future__ import annotations

from mmjax.models.units import is_llm
from mmjax.planner.unit_work import ACT_BYTES, unit_work
from mmjax.planner.workload import Workload

FORWARD_ACCESSES = 2
BACKWARD_ACCESSES = 3
REMAT_ACCESSES = 2


def accesses(bwd: int, remat: str) -> int:
    """Memory accesses per kept activation byte of a layer with backward factor `bwd`."""
    if not bwd:
        return FORWARD_ACCESSES
    return (FORWARD_ACCESSES + BACKWARD_ACCESSES
            + (REMAT_ACCESSES if remat in ("dots", "full") else 0))


def elementwise_bytes(model, wl: Workload, unit: str, remat: str = "none",
                      act_bytes: int = ACT_BYTES) -> float:
    """Bytes the elementwise passes of `unit` move for one sample of `wl` (forward and
    backward), activations of `act_bytes` bytes (4: float32)."""
    uw = unit_work(model, wl, unit)
    kept = sum(w.act_bytes * accesses(w.bwd, remat) for w in uw.layers + uw.extra)
    if is_llm(unit):  # the head's logits: priced by the step model's head term
        head = ACT_BYTES * wl.llm_moments()[0] * model.llm.vocab_size
        kept -= head * accesses(uw.layers[-1].bwd, remat)
    return kept * act_bytes / ACT_BYTES


def elementwise_s(model, wl: Workload, unit: str, hw, remat: str = "none",
                  act_bytes: int = ACT_BYTES) -> float:
    """Seconds of those passes at the device's measured streaming bandwidth."""
    return elementwise_bytes(model, wl, unit, remat, act_bytes) / hw.hbm_bw
