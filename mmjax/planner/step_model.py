"""The single-device training step's time, as `scripts/bench_step.py` measures it.

The cost model (`costs.py`) prices each unit's real tokens at the device's layer speed. A
step computes more than that and does more than compute:
- padding: the linear work of a unit runs on every slot of its static batch shape (LLM rows
  x seq_len, encoder buffers x capacity), `fills` = slots / real tokens; attention visits only
  tiles that hold real pairs, so it stays on real tokens;
- attention by the kernel that runs: a measured profile times layers with cuDNN attention;
  units whose packed masks need the Pallas kernel pay `attention_slowdown` (Pallas / cuDNN,
  `scripts/bench_pallas_tiles.py`: 1.74-1.89x on an H100 at 4k-32k);
- per-unit recomputation (`remat`: each unit's own policy, as the model config sets it);
- memory-bound fixed costs at the device's HBM bandwidth: the AdamW update over fp32 master
  weights and the LM head's float32 passes over [slots, vocabulary] logits.
What it leaves out: the elementwise forward that "dots" recomputes, XLA's copies and
gathers, host time. No JAX here.
"""
from __future__ import annotations

from dataclasses import dataclass

from mmjax.planner.costs import work_time
from mmjax.planner.unit_work import unit_work

# read master, m, v and the fp32 gradient (16 B), write master, m, v (12 B) and the compute
# copy (2 B) per trainable parameter
ADAM_BYTES_PER_PARAM = 30
# per logit: fp32 logits written, read for the max / log-sum-exp and for exp, the fp32
# gradient written, read and cast down to the compute dtype (2 B)
HEAD_BYTES_PER_LOGIT = 22
PALLAS_VS_CUDNN = 1.8  # H100, causal 4k-32k, 64 x 64 tiles (docs/results.md)


@dataclass(frozen=True)
class StepPrediction:
    units_s: dict  # per unit: compute (linear on slots, attention on real pairs), fwd + bwd
    optimizer_s: float
    head_s: float

    @property
    def total_s(self) -> float:
        return sum(self.units_s.values()) + self.optimizer_s + self.head_s


def single_step_time(model, wl, hw, samples: int, remat: dict, fills: dict,
                     trainable_params: int, logit_slots: float,
                     attention_slowdown: dict | None = None) -> StepPrediction:
    """One step over `samples` samples of workload `wl` on one device of `hw` (with its
    profile when given); `remat` {unit: policy}; `fills` {unit: slots / real tokens};
    `logit_slots` the LM head's rows x seq_len; `attention_slowdown` {unit: factor}."""
    slow = attention_slowdown or {}
    units = {}
    for u in model.unit_names:
        uw = unit_work(model, wl, u)
        lin = att = 0.0
        for w in uw.layers + uw.extra:
            f, b = work_time(w, 1, hw, remat.get(u, "none"))
            share = w.attn_flops / w.flops if w.flops else 0.0
            att += (f + b) * share
            lin += (f + b) * (1.0 - share)
        units[u] = samples * (lin * fills.get(u, 1.0) + att * slow.get(u, 1.0))
    return StepPrediction(
        units_s=units, optimizer_s=ADAM_BYTES_PER_PARAM * trainable_params / hw.hbm_bw,
        head_s=HEAD_BYTES_PER_LOGIT * logit_slots * model.llm.vocab_size / hw.hbm_bw)
