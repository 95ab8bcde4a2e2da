"""What one pipeline step returns: per-microbatch loss terms and per-stage partial
gradients, read back with one host sync after the whole schedule is dispatched."""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.pipeline.multiprocess import gather_scalars


@dataclass
class StepResult:
    """Per-microbatch loss terms as device vectors `[dp]` (each dp rank's partial sum, on the
    last stages' meshes); reading them (`losses()`) is the step's one host sync, after the
    whole schedule is dispatched. `partials[sid]`: float32 `[dp, ...]` per parameter, slot r
    dp rank r's gradient summed over the step's microbatches (not over dp ranks), for every
    local stage with trainable parameters; `[dp * cp, ...]` (slot r * cp + c: dp rank r, cp
    rank c) for an LLM stage with cp > 1."""

    lm_loss: list = field(default_factory=list)
    diffusion_loss: list = field(default_factory=list)
    trace: list = field(default_factory=list)
    partials: dict = field(default_factory=dict)
    reduced: set = field(default_factory=set)  # stages whose partials are ZeRO-2/3 shards

    @property
    def grads(self) -> dict:
        """`partials` summed over the (dp, cp) ranks (one all-reduce per stage, on request: the
        training step reduce-scatters `partials` instead); a ZeRO-2/3 stage's are summed
        already (its accumulators are the reduce-scattered shards)."""
        return {sid: p if sid in self.reduced else _sum_ranks(p)
                for sid, p in self.partials.items()}

    def losses(self) -> dict[str, float]:
        if jax.process_count() == 1:
            lm_terms = jax.device_get(self.lm_loss)
            diff_terms = jax.device_get(self.diffusion_loss)
        else:
            lm_terms, diff_terms = gather_scalars([self.lm_loss, self.diffusion_loss])
        lm = float(sum(np.sum(np.asarray(v, np.float64)) for v in lm_terms))
        diff = float(sum(np.sum(np.asarray(v, np.float64)) for v in diff_terms))
        return {"loss": lm + diff, "lm_loss": lm, "diffusion_loss": diff}


@jax.jit
def _sum_ranks(partials):
    return jax.tree.map(lambda a: jnp.sum(a, axis=0), partials)
