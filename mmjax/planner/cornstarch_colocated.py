"""Cornstarch's co-located baseline, priced by the planner's model (Cornstarch §5.1; no JAX).

Cornstarch compares modality parallelism (each encoder on its own devices, running beside
the others, Cornstarch §4.1) against the common layout where the encoders sit on the LLM's
first pipeline stage's devices (and a generator on its last stage's): the first stage runs
every encoder's forward and backward and then its LLM layers, one after another, so the
pipeline's slowest stage carries the encoders. Each unit keeps the LLM's tp (its largest
valid size not above it) and dp; the LLM's (tp, pp, dp) is searched over the GPUs and the
fastest that fits is returned, with the same stage-time, warm-up and sync terms as
`evaluate.evaluate` (DistTrain §5.1, Eq. 1-2), so it compares like for like with the
disaggregated planner's plan.
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.models.units import is_encoder, is_generator, is_llm
from mmjax.planner.candidates import divisors
from mmjax.planner.costs import UnitCost
from mmjax.planner.evaluate import (Choice, memory_bytes, stage_time, sync_time,
                                    warmup_time)
from mmjax.planner.hardware import Hardware
from mmjax.planner.plan import PlanError


@dataclass(frozen=True)
class CornstarchColocated:
    iteration_time_s: float
    gpus: int
    llm: Choice
    stage_time_s: dict[str, float]  # "first" (encoders + LLM stage), "llm", "last"
    memory_gb: float  # the fullest stage's device
    samples_per_s: float

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["llm"] = {"tp": self.llm.tp, "dp": self.llm.dp, "pp": self.llm.pp}
        return out


def _tp_for(cost: UnitCost, tp: int) -> int | None:
    ok = [t for t in cost.time_s if t <= tp]
    return max(ok) if ok else None


def cornstarch_colocated(costs: tuple[UnitCost, ...], hw: Hardware, num_gpus: int,
                         global_batch: int) -> CornstarchColocated:
    """The fastest baseline that fits (module docstring); PlanError when none does."""
    llm = next(c for c in costs if is_llm(c.name))
    gen = [c for c in costs if is_generator(c.name)]
    encs = [c for c in costs if is_encoder(c.name)]
    best, why = None, "no (tp, pp, dp) divides the GPUs and the batch"
    for tp in sorted(llm.time_s):
        for pp in divisors(llm.num_layers):
            for dp in divisors(global_batch):
                if tp * pp * dp != num_gpus:
                    continue
                m = global_batch // dp
                ch = Choice(tp, dp, pp)
                side = {}
                for c in encs + gen:
                    t = _tp_for(c, tp)
                    if t is None:
                        break
                    side[c.name] = Choice(t, dp, 1)
                if len(side) != len(encs) + len(gen):
                    continue
                llm_mem = memory_bytes(llm, ch, dp, m)
                first = llm_mem + sum(memory_bytes(c, side[c.name], dp, m) for c in encs)
                last = llm_mem + sum(memory_bytes(c, side[c.name], dp, m) for c in gen)
                mem = max(first, last) if pp > 1 else llm_mem + sum(
                    memory_bytes(c, side[c.name], dp, m) for c in encs + gen)
                if mem > hw.hbm_bytes:
                    why = (f"the leanest tried (tp {tp}, pp {pp}, dp {dp}) needs "
                           f"{mem / 1e9:.1f} GB per GPU; have {hw.hbm_bytes / 1e9:.0f} GB")
                    continue
                s_llm = stage_time(llm, ch, dp)
                s_enc = sum(stage_time(c, side[c.name], dp) for c in encs)
                s_gen = sum(stage_time(c, side[c.name], dp) for c in gen)
                stages = ({"first": s_llm + s_enc + s_gen} if pp == 1 else
                          {"first": s_llm + s_enc, "llm": s_llm, "last": s_llm + s_gen})
                warm = (warmup_time(llm, ch, dp, hw)
                        + sum(warmup_time(c, side[c.name], dp, hw) for c in encs + gen))
                sync = max([sync_time(llm, ch, hw)]
                           + [sync_time(c, side[c.name], hw) for c in encs + gen])
                total = warm + max(stages.values()) * (m - 1) + sync
                if best is None or total < best.iteration_time_s:
                    best = CornstarchColocated(total, num_gpus, ch, stages, mem / 1e9,
                                               global_batch / total)
    if best is None:
        raise PlanError(f"Cornstarch co-located baseline: nothing fits {num_gpus} GPUs: {why}")
    return best
