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
- XLA's dense attention (`SlotShapes`: a CPU, or `--attention xla`): it computes every
  (query, key) pair of each static row and encoder buffer, masked or not, so the LLM and the
  encoders are priced on their static shapes (rows of seq_len tokens, buffers of capacity
  tokens), each layer at the profile's efficiency for one sequence of that length (what the
  profile's layer points time: one sequence, XLA's attention) - not on the real tokens at
  the step's total token count.
- the layers' memory-bound elementwise passes (norms, residuals, RoPE, activations) at the
  measured streaming bandwidth (`elementwise.py`).
What it leaves out: XLA's copies and gathers outside the layers, host time. No JAX here.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from mmjax.models.units import LLM_UNIT, is_llm
from mmjax.planner.costs import work_time
from mmjax.planner.elementwise import elementwise_s
from mmjax.planner.unit_work import unit_work
from mmjax.planner.workload import Workload

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
    elementwise_s: dict = field(default_factory=dict)  # per unit: memory-bound passes

    @property
    def total_s(self) -> float:
        return (sum(self.units_s.values()) + sum(self.elementwise_s.values())
                + self.optimizer_s + self.head_s)


@dataclass(frozen=True)
class SlotShapes:
    """A step's static shapes as XLA's dense attention computes them: `rows` LLM rows of
    `seq_len` tokens; per encoder, (buffers, capacity tokens each)."""
    rows: int
    seq_len: int
    encoders: dict  # name -> (buffers, capacity)


def slot_workloads(model, wl, slots: SlotShapes) -> dict:
    """{unit: (workload of one static row / buffer, how many of them)} for the LLM and the
    encoders: every slot a "sample" of one full sequence (causal pairs counted as the
    profile's layers count them), the generator's conditioning as `wl`'s."""
    out = {LLM_UNIT: (Workload("slots", (slots.seq_len,), cond_tokens=wl.cond_tokens),
                   slots.rows)}
    for name, (count, cap) in slots.encoders.items():
        out[name] = (Workload("slots", (slots.seq_len,), {name: ((cap,),)},
                              cond_tokens=wl.cond_tokens), count)
    return out


def dense_attention_s(model, unit: str, tokens: int, hw, bwd: int = 2,
                      remat: str = "none") -> float:
    """Seconds of unit `unit`'s attention over one sequence of `tokens` tokens under XLA's
    dense attention: every layer computes heads x tokens^2 pairs at the device's measured
    time per pair (`hw.dense_pair_s`, forward + backward at head dim
    `hw.dense_pair_head_dim`), plus or minus the Q K^T and P V FLOPs (12 per pair and head
    dim, forward + backward) of the unit's own head dim at the device's peak. `bwd`: the
    unit's backward factor (0 frozen, 2 trained); "dots" / "full" remat re-run the forward."""
    if is_llm(unit):
        c = model.llm
        layers, hd = c.num_layers, c.dim_per_head
    else:
        c = model.encoder(unit).encoder
        layers, hd = getattr(c, "depth", c.num_layers), c.hidden_size // c.num_heads
    pair = max(hw.dense_pair_s + 12.0 * (hd - hw.dense_pair_head_dim) / hw.peak_flops,
               12.0 * hd / hw.peak_flops)
    passes = 1 + bwd + (1 if bwd and remat in ("dots", "full") else 0)  # of 3: fwd + bwd
    return layers * c.num_heads * tokens * tokens * pair * passes / 3.0


def unit_seconds(model, wl, hw, u, remat: str) -> tuple[float, float]:
    """(linear, attention) forward + backward seconds of unit `u` for one sample of `wl`."""
    lin = att = 0.0
    uw = unit_work(model, wl, u)
    for w in uw.layers + uw.extra:
        f, b = work_time(w, 1, hw, remat)
        share = w.attn_flops / w.flops if w.flops else 0.0
        att += (f + b) * share
        lin += (f + b) * (1.0 - share)
    return lin, att


def single_step_time(model, wl, hw, samples: int, remat: dict, fills: dict,
                     trainable_params: int, logit_slots: float,
                     attention_slowdown: dict | None = None,
                     slots: SlotShapes | None = None, act_bytes: int = 2) -> StepPrediction:
    """One step over `samples` samples of workload `wl` on one device of `hw` (with its
    profile when given); `remat` {unit: policy}; `fills` {unit: slots / real tokens};
    `logit_slots` the LM head's rows x seq_len; `attention_slowdown` {unit: factor};
    `slots`: the static shapes, when attention is XLA's dense one (units it names are
    priced on them, layers at the efficiency of one row: `call_tokens` 0); `act_bytes`: the
    activations' dtype size (the elementwise passes, planner/elementwise.py)."""
    slow = attention_slowdown or {}
    dense = slot_workloads(model, wl, slots) if slots is not None else {}
    units, passes = {}, {}
    for u in model.unit_names:
        if u in dense:
            slot_wl, count = dense[u]
            lin, att = unit_seconds(model, slot_wl, replace(hw, call_tokens=0.0), u,
                                     remat.get(u, "none"))
            if hw.dense_pair_s > 0:  # measured: pairs x heads, not FLOPs
                assert slots is not None  # `dense` is empty without slots
                tokens = slots.seq_len if is_llm(u) else slots.encoders[u][1]
                att = dense_attention_s(model, u, tokens, hw,
                                        unit_work(model, slot_wl, u).layers[0].bwd,
                                        remat.get(u, "none"))
            units[u] = count * (lin + att)
            passes[u] = count * elementwise_s(model, slot_wl, u, hw, remat.get(u, "none"),
                                              act_bytes)
            continue
        lin, att = unit_seconds(model, wl, hw, u, remat.get(u, "none"))
        units[u] = samples * (lin * fills.get(u, 1.0) + att * slow.get(u, 1.0))
        passes[u] = samples * fills.get(u, 1.0) * elementwise_s(
            model, wl, u, hw, remat.get(u, "none"), act_bytes)
    return StepPrediction(
        units_s=units, optimizer_s=ADAM_BYTES_PER_PARAM * trainable_params / hw.hbm_bw,
        head_s=HEAD_BYTES_PER_LOGIT * logit_slots * model.llm.vocab_size / hw.hbm_bw,
        elementwise_s=passes)
