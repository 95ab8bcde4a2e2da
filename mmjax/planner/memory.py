"""Per-stage device memory of the pipeline runtime, term by term (no JAX).

DistTrain §5.1 bounds each GPU's memory by its unit's weights, optimizer state and the
activations 1F1B keeps in flight; this module counts them as the runtime holds them, so a
plan the planner accepts is a plan that fits:

- fp32 master weights and AdamW m, v: ZeRO-1 shards, 1/dp of the stage's TP shard
  (parallel/zero.py `Zero1Optimizer`), 12 bytes per trainable parameter / (tp dp);
- the compute copy of the trainable parameters in the compute dtype (/tp);
- frozen parameters in float32 (they are placed as built and cast inside the stage);
- the step's float32 gradient accumulators `[dp, ...]`: each rank its own full TP shard
  (pipeline/stage.py: no dp collective inside a microbatch), 4 bytes / tp;
- per in-flight microbatch the vjp residuals under the unit's remat policy;
- one microbatch's working set: the parameter cotangents in the compute dtype, and the
  backward of "full" / "dots" re-runs the stage forward (the checkpoint wraps the whole
  stage), holding what "none" would have kept, while "none" holds about three fp32
  attention-score buffers of a layer;
- the optimizer step: master, gradient shards, m, v, their new values and the gathered
  compute copy (the accumulators are gone by then).

Per unit ZeRO stage z over the stage's ZeRO group of d dp ranks (`fsdp_group`, or all of
its dp ranks; `zero_terms`, the one formula of both layouts' sharded state):
- z = 2: the accumulators are the ZeRO shards, 4 / d bytes; each backward casts its
  per-rank partials into one flat float32 buffer for the reduce-scatter (4 bytes per
  parameter beside the cotangents; compiled at float32 the backward's temporaries hold two
  parameter-sized copies, as counted, where ZeRO-1's hold 1.8 and its term counts one:
  a weight-dominated ZeRO-1 stage at dp 8 is underestimated by ~19%);
- z = 3: also the compute copy and the frozen weights stored sharded (/ d) and shared by
  the ranks. Each layer is gathered whole inside the layer scan: the forward holds
  `GATHERED_FORWARD` layer's full weights, the backward `GATHERED_BACKWARD` (the layer
  gathered again and its whole gradient before the reduce-scatter); besides, the scan
  stacks the shards (a copy of the compute shards in the forward; in the backward also
  the stacked cotangents and their float32 cast: `STACK_COPIES`), and the step writes
  the new compute shards in place of the all-gather.

Residual counts per token follow the vjp of each module (models/llm.py, vision.py,
generator.py) as XLA keeps them, tensor by tensor: on the plain TP path hidden-size tensors
are replicated over TP ranks (no sequence parallelism) while heads, FFN and attention
scores are split. The dense attention path keeps float32 logits and probabilities and two
boolean masks per (query, key) pair and two float32 row statistics; tiled implementations
keep one log-sum-exp per row (planner/attention_cost.py). "dots" keeps the outputs of the
weight matmuls (Megatron selective recomputation: Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", §4.2) and the stage input; "full" keeps the
stage input alone.

Checked against each compiled stage program's `memory_analysis()` on CPU
(tests/test_memory_model.py): float32 compute; bfloat16 halves the same tensors except the
float32 statistics, attention scores and logits, as counted here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from mmjax.planner.attention_cost import ROW_BYTES

REMATS = ("none", "dots", "full")  # least recompute first: the planner's order of preference
MASTER_BYTES = 4  # fp32 master shard
ADAM_BYTES = 8  # fp32 m and v shards
OPTIMIZER_BYTES = MASTER_BYTES + ADAM_BYTES
ACC_BYTES = 4  # fp32 per-rank gradient accumulators
FROZEN_BYTES = 4  # frozen parameters stay float32
F32 = 4
DENSE_PAIR_BYTES = 10  # fp32 logits + probabilities, two boolean masks, per pair
DENSE_ROW_BYTES = 8  # fp32 row max and row sum
SCORE_BUFFERS = 3  # fp32 score buffers a layer's backward holds at once (dense path)
STEP_BYTES = 12  # optimizer step beyond the state: fp32 gradient shard, 8 bytes of updates
ZERO_STAGES = (1, 2, 3)
GATHERED_FORWARD = 1  # ZeRO-3: layers' full weights a forward holds (the one gathered)
GATHERED_BACKWARD = 2  # ZeRO-3 backward: the layer gathered again and its whole gradient
STACK_COPIES = 3  # ZeRO-3 backward per shard: stacked weights, stacked cotangents, their f32


def zero_divisors(zero: int, dp) -> tuple:
    """(gradient, weight) divisors of ZeRO stage `zero` over `dp` ranks: stage 2 shards the
    float32 gradients, stage 3 also the stored parameters (compute copy, frozen weights);
    the optimizer state is / dp at every stage."""
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero_stage={zero!r}: use one of {ZERO_STAGES}")
    return (dp if zero >= 2 else 1), (dp if zero == 3 else 1)


@dataclass(frozen=True)
class ZeroTerms:
    """Parameter-sized bytes of one pipeline stage on one device at a ZeRO stage (module
    docstring), shared by `stage_memory` (runtime shapes) and `unit_stage_bytes` (the
    planner's whole-unit terms)."""

    master: float
    optimizer: float
    params: float  # compute copy
    frozen: float
    accumulators: float
    forward: float  # a forward's parameter-sized temporaries (ZeRO-3's stacked shards)
    backward: float  # a backward's: the cotangents, ZeRO-2's flat buffer, ZeRO-3's stacks
    step: float  # the optimizer step beyond master, m, v, frozen and the compute copy
    gathered_forward: float  # ZeRO-3: full layers' weights live in a forward
    gathered_backward: float  # ... and in a backward


def zero_terms(trainable: float, frozen: float, b: int, zero: int, dp, layer: float = 0.0,
               scanned: bool = True) -> ZeroTerms:
    """`trainable` / `frozen` parameters of a stage on one TP rank, compute dtype `b`
    bytes, ZeRO stage `zero` over `dp` ranks (the ZeRO group), `layer` the bytes of one
    layer's full weights as the scan gathers them (compute dtype, frozen in float32);
    `scanned` False: a stage of one layer, which runs without the scan's stacked copies
    (its cotangent shards and their float32 cast alone)."""
    g, w = zero_divisors(zero, dp)
    s = trainable / dp
    backward = b * trainable + (ACC_BYTES * trainable if zero == 2 else 0.0)
    stacked = gathered = 0.0
    if zero == 3:  # with dp > 1: the runtime gathers in the scan only then
        many = dp > 1
        stacked = many * scanned * (b * trainable + FROZEN_BYTES * frozen) / dp
        gathered = many * layer
        z3 = ((STACK_COPIES - 1) * b * trainable + ACC_BYTES * trainable
              + FROZEN_BYTES * frozen) / dp if scanned else (b + ACC_BYTES) * trainable / dp
        # over an array of dp every term here is an array (elementwise floats)
        backward = (cast(float, np.where(many, z3, backward)) if isinstance(many, np.ndarray)
                    else z3 if many else backward)
    return ZeroTerms(master=MASTER_BYTES * s, optimizer=ADAM_BYTES * s,
                     params=b * trainable / w, frozen=FROZEN_BYTES * frozen / w,
                     accumulators=ACC_BYTES * trainable / g, forward=stacked,
                     backward=backward, step=step_bytes(b, dp, zero) * s + b * trainable / w,
                     gathered_forward=GATHERED_FORWARD * gathered,
                     gathered_backward=GATHERED_BACKWARD * gathered)


@dataclass(frozen=True)
class Acts:
    """Activation bytes of one sample through a whole unit on one TP rank."""

    none: float  # every residual ("none")
    dots: float  # weight-matmul outputs ("dots"), stage input excluded
    scores: float  # one fp32 attention-score buffer of one layer (the backward's unit)
    boundary: float  # one stage output (and its cotangent), the next stage's input
    input: float  # the stage input, all "full" keeps ("dots" too); none on a first stage
    mask: float = 0.0  # one boolean per attention pair (dense path)

    def kept(self, remat: str) -> float:
        """Residuals kept per in-flight microbatch, stage input excluded."""
        return {"none": self.none, "dots": self.dots, "full": 0.0}[remat]

    def recomputed(self, remat: str) -> float:
        """What the backward of one microbatch rebuilds: the stage forward's residuals but
        one byte per attention pair (a mask XLA fuses into its consumer when it recomputes
        it inside the backward program instead of keeping it; measured)."""
        return 0.0 if remat == "none" else self.none - self.mask - self.kept(remat)


def attention_bytes(tokens: float, pairs: float, heads: float, impl: str | None) -> tuple:
    """(kept, one score buffer) bytes of `heads` heads for one sample: `pairs` the (query,
    key) pairs the dense path computes, `tokens` the query rows."""
    if impl == "dense":
        return heads * (DENSE_PAIR_BYTES * pairs + DENSE_ROW_BYTES * tokens), heads * F32 * pairs
    return heads * ROW_BYTES * tokens, 0.0


def _mask(pairs: float, heads: float, impl: str | None) -> float:
    return heads * pairs if impl == "dense" else 0.0


def llm_acts(c, tokens: float, pairs: float, tp: int, b: int, impl: str | None,
             layers: int | None = None, first: bool = True, last: bool = True,
             enc_tokens: float | None = None) -> Acts:
    """The LLM (models/llm.py DecoderLayer), per layer per token: replicated x, two
    normed inputs for each of attention and MLP and the residual sum (6d), four fp32 norm
    statistics and the RoPE tables (2 hd); split over TP: roped q and k, v, the attention
    output (2 h hd + 2 kv hd) and six FFN-width tensors (gate, up, SiLU parts, product).
    The first stage adds the modality-merge mask, the last the final norm, fp32 logits and
    the loss masks."""
    d, hd, h, kv, f, v = (c.hidden_size, c.dim_per_head, c.num_heads, c.num_kv_heads,
                          c.ffn_size, c.vocab_size)
    n, L = tokens, c.num_layers if layers is None else layers
    kept, scores = attention_bytes(n, pairs, h / tp, impl)
    layer = (n * (b * (6 * d + 2 * hd) + F32 * 4)
             + b * n * (2 * h * hd + 2 * kv * hd + 6 * f) / tp + kept)
    # the fp32 logits, unless `loss_chunk` fuses the head with the loss (one chunk's logits
    # at a time: transient work, models/chunked_loss.py)
    logits = 0.0 if c.loss_chunk else F32 * v
    head = n * (b * 3 * d + F32 * 2 + logits + 9) if last else 0.0
    layer_dots = b * n * (2 * d + (h * hd + 2 * kv * hd + 2 * f) / tp)
    return Acts(none=L * layer + first * n * (d + 8) + head,
                dots=L * layer_dots + (n * logits if last else -b * n * d), scores=scores,
                boundary=b * n * d,
                input=b * d * (n if not first else n if enc_tokens is None else enc_tokens),
                mask=L * _mask(pairs, h / tp, impl))


def encoder_acts(c, tokens: float, pairs: float, tp: int, b: int, impl: str | None,
                 in_dim: int, out_tokens: float, out_dim: int, layers: int | None = None,
                 first: bool = True, last: bool = True) -> Acts:
    """A ViT / Whisper encoder (models/vision.py, audio.py) with its projector, per layer
    per token: 11 replicated hidden-size tensors and five fp32 LayerNorm statistics; split
    over TP: q, k, v (3 d) and nine FFN-width tensors (fc1, GELU parts); the first stage
    keeps its patch / frame input, the projector a few LLM-width tensors per output token."""
    d, f, h = c.hidden_size, c.ffn_size, c.num_heads
    n = tokens
    if layers is None:
        layers = getattr(c, "depth", None) or c.num_layers
    kept, scores = attention_bytes(n, pairs, h / tp, impl)
    layer = n * (b * 11 * d + F32 * 5) + b * n * (3 * d + 9 * f) / tp + kept
    front = first * n * (b * in_dim + 8)
    layer_dots = b * n * (2 * d + (3 * d + f) / tp)
    return Acts(none=layers * layer + front + last * b * out_tokens * 3 * out_dim,
                dots=layers * layer_dots + last * b * out_tokens * 2 * out_dim, scores=scores,
                boundary=b * (out_tokens * out_dim if last else n * d),
                input=0.0 if first else b * n * d, mask=layers * _mask(pairs, h / tp, impl))


def generator_acts(g, images: float, cond: float, tp: int, b: int, layers: int | None = None,
                   first: bool = True, last: bool = True, cond_dim: int | None = None,
                   impl: str | None = None) -> Acts:
    """The DiT (models/generator.py), per block per image of n patches and m conditioning
    tokens: self- and cross-attention (full masks: no mask buffers; the dense path keeps
    fp32 logits and probabilities, a tiled one a row statistic), adaLN modulation."""
    d, f, h, n, m = g.hidden_size, g.ffn_size, g.num_heads, g.num_patches, cond
    dense = impl == "dense"
    per = h / tp * (2 * F32 * (n * n + n * m) + 2 * DENSE_ROW_BYTES * n if dense
                    else 2 * ROW_BYTES * n)
    block = (b * (n * 12 * d + m * 4 * d + 7 * d) + F32 * 7 * n
             + b * (n * (7 * d + 6 * f)) / tp + per)
    block_dots = b * (n * 6 * d + 7 * d) + b * n * (4 * d + f) / tp
    L = g.num_layers if layers is None else layers
    ends = b * n * (first * (g.patch_dim + 2 * d) + last * g.patch_dim)
    return Acts(none=images * (L * block + ends), dots=images * L * block_dots,
                scores=images * h / tp * F32 * n * n if dense else 0.0,
                boundary=b * images * n * d,
                input=b * images * (m * (cond_dim or d) if first else n * d))


@dataclass(frozen=True)
class StageMemory:
    """One device of one stage, bytes (the runtime's buffers, see the module docstring)."""

    master: float
    optimizer: float  # AdamW m, v shards
    params: float  # compute copy
    frozen: float
    accumulators: float
    residuals: float  # one microbatch under the remat policy
    in_flight: float
    forward_work: float
    backward_work: float
    step_work: float  # the optimizer step's gradient shards, new values, gathered copy
    io: float  # stage input, output and cotangents of one microbatch

    @property
    def state(self) -> float:
        return self.master + self.optimizer + self.params + self.frozen + self.accumulators

    @property
    def peak(self) -> float:
        run = self.state + self.in_flight * self.residuals + self.io
        step = (self.master + self.optimizer + self.params + self.frozen + self.step_work)
        return max(run + self.forward_work, run + self.backward_work, step)


def scan_checkpoint_acts(acts: Acts, remat: str, layers: int) -> tuple[float, float]:
    """(kept per in-flight microbatch, one backward's rebuilt bytes) of one sample when the
    layer scan checkpoints each layer under "dots" (models/scan.py: a ZeRO-3 stage's gather
    sets it, so no gathered weight is saved): the stage keeps the "dots" residuals (plus
    its input) under "none" and "dots" and its input alone under "full", whose backward
    first re-runs the forward (keeping the "dots" residuals again); a backward rebuilds
    one layer's other residuals at a time, plus one score buffer."""
    one = (acts.none - acts.dots) / max(layers, 1) + acts.scores
    if remat == "full":
        return acts.input, acts.dots + one
    return acts.dots + acts.input, one


def stage_memory(trainable: float, frozen: float, acts: Acts, remat: str, dp: int,
                 samples: float, in_flight: float, b: int, zero: int = 1,
                 zero_dp: int | None = None, layer: float = 0.0,
                 layers: int = 1) -> StageMemory:
    """One stage on one device: `trainable` / `frozen` the parameters one TP rank holds
    (`tp_rank_params`), `acts` its `layers` layers' (one sample), `samples` per dp rank per
    microbatch, `b` the compute dtype's bytes; ZeRO stage `zero` over `zero_dp` ranks (its
    FSDP group; default all `dp`), `layer` one layer's gathered bytes (`zero_terms`)."""
    z = zero_terms(trainable, frozen, b, zero, zero_dp or dp, layer, layers > 1)
    if zero == 3 and (zero_dp or dp) > 1:  # each layer checkpointed in the gathering scan
        keep, rebuilt = scan_checkpoint_acts(acts, remat, layers)
        keep, bwd = samples * keep, z.backward + z.gathered_backward + samples * rebuilt
    else:
        keep = samples * (acts.kept(remat) + (acts.input if remat != "none" else 0))
        bwd = z.backward + z.gathered_backward + samples * (
            SCORE_BUFFERS * acts.scores if remat == "none" else acts.recomputed(remat))
    fwd = z.forward + z.gathered_forward + samples * acts.scores * (1 if remat == "none" else 2)
    return StageMemory(master=z.master, optimizer=z.optimizer, params=z.params,
                       frozen=z.frozen, accumulators=z.accumulators, residuals=keep,
                       in_flight=in_flight, forward_work=fwd, backward_work=bwd,
                       step_work=z.step, io=samples * (acts.input + 2 * acts.boundary))


def tp_rank_params(params: float, replicated: float, tp: int) -> float:
    """Parameters one TP rank holds: Megatron's rules split all but `replicated` (norms,
    row-parallel biases, adaLN modulation, embeddings outside the blocks, projectors:
    parallel/tensor.py `megatron_role`)."""
    return (params - replicated) / tp + replicated


def step_bytes(b: int, dp, zero: int = 1):
    """Optimizer-step bytes per parameter of the ZeRO-1 shard beyond master, m and v: the
    fp32 gradient shard, the new master, m and v (8, reused by donation but for 8 bytes),
    and with dp > 1 the compute-dtype shard the all-gather sends (none at ZeRO-3: the new
    compute shards are the step's output)."""
    return STEP_BYTES + b * ((dp > 1) & (zero < 3))


def unit_stage_bytes(weight, optimizer, act, boundary, work, fixed, step_weight, rep, tp, dp,
                     pp, spr, flight, b, zero: int = 1, gathered=0.0):
    """The planner's per-GPU bytes of one stage of a unit (numpy-broadcastable), the larger
    of the pipeline's run and the optimizer step. Whole-unit terms, on one TP rank as
    `tp_rank_params` counts them (`rep`: the fraction of parameters TP replicates), then
    / pp: `weight` (compute copy, frozen, accumulators, and under "none" the parameter
    cotangents), `optimizer` (master, m, v; also / dp), `step_weight` (the step's old and
    new compute copies, frozen); per sample: `act` (residuals kept per in-flight
    microbatch, / pp), `work` (what one microbatch's backward rebuilds, / pp), `boundary`
    (the stage input, kept per in-flight microbatch by "dots" / "full", plus one
    microbatch's input, output and cotangents) and `fixed` (attention score buffers).
    ZeRO stage `zero` > 1: `weight` and `step_weight` are `zero_terms`' (sharded over `dp`,
    the ZeRO group) and `gathered` the whole layers a ZeRO-3 backward holds (one TP rank's
    share, not / pp: one layer at a time whatever the stage's depth)."""
    tp_share = (1 - rep) / tp + rep
    share = tp_share / pp
    run = (weight + optimizer / dp) * share + spr * (flight * (act / pp + boundary)
                                                     + work / pp + fixed)
    if zero == 3:
        run = run + gathered * tp_share
    if step_weight is None:  # a cost without the step's terms (hand-made tests)
        return run
    step = (step_weight + optimizer * (1 + step_bytes(b, dp, zero) / OPTIMIZER_BYTES) / dp
            ) * share
    if isinstance(run, float) and isinstance(step, float):  # the scalar path: no numpy
        return max(run, step)
    return np.maximum(run, step)
