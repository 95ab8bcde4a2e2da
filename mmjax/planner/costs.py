"""Analytic cost model of every unit (no JAX): parameters, FLOPs, time, memory, traffic.

- Parameters follow the Flax modules' layout exactly (`num_params`).
- Forward FLOPs per sample: 2 x tokens x matmul weights, plus the attention quadratic term
  summed over a sample's subsequences (DistTrain §2.3: sizes are skewed, so E[n^2] != E[n]^2).
  With an `attention_impl` (per unit) the LLM's and encoders' attention FLOPs and kept bytes
  come from the tiles that implementation computes (planner/attention_cost.py): the dense
  path pays every pair and keeps [S, S] float32 buffers, the tiled ones pay non-empty tiles
  and keep one float per row; without one, the exact allowed pairs and no [S, S] buffer.
- Backward time follows Cornstarch's rule (Cornstarch §4.2): 0 x forward for a frozen module
  with nothing trainable before it, 1 x (input gradients only) for a frozen module with a
  trainable module before it, 2 x for a trainable module; activation recomputation adds one
  forward where a backward runs.
- Memory per GPU (DistTrain §5.1): bf16 weights and fp32 gradients sharded by TP x PP,
  fp32 master + Adam moments additionally by DP (ZeRO-1), activations of the microbatches
  1F1B keeps in flight on the first stage.
- Communication is volume / bandwidth: TP all-reduces inside C(TP), PP point-to-point of
  one boundary tensor, DP reduce-scatter + all-gather of gradients/parameters.

`unit_costs(model, workload, hw)` reduces all of it to one `UnitCost` per unit; the
orchestrator only sees `UnitCost`s (and `profile.py` can replace their times by measured
piecewise-linear tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmjax.models.config import (AudioConfig, GeneratorConfig, LLMConfig, MLLMConfig,
                                 ProjectorConfig, VisionConfig)
from mmjax.planner.attention_cost import computed_pairs, kept_bytes_per_head
from mmjax.planner.hardware import Hardware
from mmjax.planner.workload import Workload

TP_SIZES = (1, 2, 4, 8)
WEIGHT_BYTES = 2  # bf16 compute copy
GRAD_BYTES = 4  # fp32 gradient
OPTIMIZER_BYTES = 12  # fp32 master + Adam m, v (ZeRO-1: sharded over DP)
ACT_BYTES = 2  # bf16 activations


# ---- parameters --------------------------------------------------------------------------
def _encoder_layer_params(d: int, f: int) -> int:
    return 2 * d + 4 * (d * d + d) + 2 * d + d * f + f + f * d + d


def llm_params(c: LLMConfig) -> int:
    d, hd, h, kv, f, v = (c.hidden_size, c.dim_per_head, c.num_heads, c.num_kv_heads,
                          c.ffn_size, c.vocab_size)
    b = 1 if c.qkv_bias else 0
    layer = (d + d * h * hd + b * h * hd + 2 * (d * kv * hd + b * kv * hd) + h * hd * d
             + d + 3 * d * f)
    return v * d + c.num_layers * layer + d + (0 if c.tie_embeddings else d * v)


def vision_params(c: VisionConfig) -> int:
    d = c.hidden_size
    layers = c.depth * _encoder_layer_params(d, c.ffn_size)
    if c.kind == "packed":
        return c.patch_dim * d + d + 2 * c.max_grid * d + layers + 2 * d
    return (c.patch_dim * d + d * c.patch_bias + c.num_positions * d + d * c.class_token
            + 2 * d * c.pre_norm + layers + 2 * d * c.final_norm)


def audio_params(c: AudioConfig) -> int:
    d = c.hidden_size
    return (c.num_mel_bins * 3 * d + d + d * 3 * d + d + c.max_source_positions * d
            + c.num_layers * (_encoder_layer_params(d, c.ffn_size) - d) + 2 * d)  # no k bias


def _mlp_dims(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> list[int]:
    h = p.hidden_size or llm_dim
    return [enc_dim * p.downsample] + [h] * (p.num_layers - 1) + [llm_dim]


def projector_params(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> int:
    if p.kind == "mlp":
        dims = _mlp_dims(p, enc_dim, llm_dim)
        return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
    e, h = enc_dim, p.hidden_size or llm_dim
    return p.num_queries * e + 4 * e + 4 * (e * e + e) + e * h + h + h * llm_dim + llm_dim


def generator_params(g: GeneratorConfig, cond_dim: int) -> int:
    d, f, pd = g.hidden_size, g.ffn_size, g.patch_dim
    block = (d * 6 * d + 6 * d) + 4 * (d * d + d) + 2 * d + 4 * (d * d + d) + d * f + f + f * d + d
    return (pd * d + d + 256 * d + d + d * d + d + cond_dim * d + d + g.num_layers * block
            + d * 2 * d + 2 * d + d * pd + pd)


def module_params(model: MLLMConfig) -> dict[str, int]:
    """Parameters per module: '<enc>', '<enc>.projector', 'llm', 'generator'."""
    out = {}
    for e in model.encoders:
        enc = e.encoder
        out[e.name] = vision_params(enc) if isinstance(enc, VisionConfig) else audio_params(enc)
        out[f"{e.name}.projector"] = projector_params(e.projector, enc.hidden_size,
                                                      model.llm.hidden_size)
    out["llm"] = llm_params(model.llm)
    if model.generator is not None:
        out["generator"] = generator_params(model.generator, model.llm.hidden_size)
    return out


def num_params(config, cond_dim: int | None = None) -> int:
    """Parameter count of a model or module config (exactly the Flax layout)."""
    if isinstance(config, MLLMConfig):
        return sum(module_params(config).values())
    if isinstance(config, LLMConfig):
        return llm_params(config)
    if isinstance(config, VisionConfig):
        return vision_params(config)
    if isinstance(config, AudioConfig):
        return audio_params(config)
    if isinstance(config, GeneratorConfig):
        if cond_dim is None:
            raise ValueError("num_params(GeneratorConfig) needs cond_dim= (the LLM hidden size)")
        return generator_params(config, cond_dim)
    raise TypeError(f"num_params: unsupported config type {type(config).__name__}")


# ---- frozen status (Cornstarch §4.2) --------------------------------------------------------
def backward_factor(frozen: bool, trainable_before: bool) -> int:
    """Backward time in units of forward time (Cornstarch §4.2)."""
    if not frozen:
        return 2
    return 1 if trainable_before else 0


def module_backward_factors(model: MLLMConfig) -> dict[str, int]:
    """Backward factor of every module, walking the DAG encoders -> projectors -> LLM ->
    generator."""
    out, any_branch = {}, False
    for e in model.encoders:
        out[e.name] = backward_factor(e.frozen, False)
        out[f"{e.name}.projector"] = backward_factor(e.projector_frozen, not e.frozen)
        any_branch |= not (e.frozen and e.projector_frozen)
    out["llm"] = backward_factor(model.llm_frozen, any_branch)
    if model.generator is not None:
        out["generator"] = backward_factor(model.generator_frozen,
                                           any_branch or not model.llm_frozen)
    return out


# ---- per-layer forward work ---------------------------------------------------------------
@dataclass(frozen=True)
class Work:
    """Forward work of one piece of a unit for one (average) sample."""

    flops: float  # forward FLOPs
    width: int  # hidden width that sets matmul efficiency
    allreduce_bytes: float  # TP all-reduce volume of the forward (at tp > 1)
    act_bytes: float  # activation bytes kept for backward at tp = 1 (TP + sequence
    #                   parallelism split all of it over the TP group)
    in_bytes: float  # the layer input: all that activation recomputation keeps
    bwd: int  # backward factor (Cornstarch rule)


@dataclass(frozen=True)
class UnitWork:
    name: str
    layers: tuple[Work, ...]  # one entry per layer (pre/post work folded into first/last)
    extra: tuple[Work, ...]  # pieces on the last stage (projector) with their own bwd factor
    params: int
    trainable_params: int
    boundary_bytes: float  # output of one layer for one sample (p2p volume)
    tp_divides: tuple[int, ...]  # sizes TP must divide


def _attention_terms(sizes, impl: str, causal: bool, heads: int) -> tuple[float, float]:
    """Mean over samples of (computed pairs, kept attention bytes of all heads); sizes: per
    sample, the lengths of its attention segments."""
    pairs = np.mean([sum(computed_pairs(n, impl, causal) for n in s) for s in sizes])
    kept = np.mean([sum(kept_bytes_per_head(n, impl) for n in s) for s in sizes]) * heads
    return float(pairs), float(kept)


def _llm_work(model: MLLMConfig, wl: Workload, bwd: int, impl: str | None = None) -> list[Work]:
    c = model.llm
    d, hd, h, kv, f, v = (c.hidden_size, c.dim_per_head, c.num_heads, c.num_kv_heads,
                          c.ffn_size, c.vocab_size)
    n1, n2 = wl.llm_moments()
    w = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    attn = 2 * n2 * h * hd  # exact causal pairs: half of 4 n^2 h hd
    kept = 0.0
    if impl is not None:
        pairs, kept = _attention_terms([(n,) for n in wl.llm_tokens], impl, True, h)
        attn = 4 * pairs * h * hd
    layer = Work(flops=2 * n1 * w + attn, width=d,
                 allreduce_bytes=2 * n1 * d * ACT_BYTES,
                 act_bytes=ACT_BYTES * n1 * (10 * d + 3 * f) + kept, in_bytes=ACT_BYTES * n1 * d,
                 bwd=bwd)
    head = Work(2 * n1 * d * v, d, 0.0, ACT_BYTES * n1 * v, 0.0, bwd)
    works = [layer] * c.num_layers
    works[-1] = _merge(works[-1], head)
    return works


def _encoder_work(model: MLLMConfig, wl: Workload, name: str, bwd: int,
                  impl: str | None = None) -> list[Work]:
    spec = model.encoder(name)
    c = spec.encoder
    d, f = c.hidden_size, c.ffn_size
    n1, n2 = wl.encoder_moments(name)
    attn, kept = 4 * n2 * d, 0.0
    if impl is not None:  # bidirectional inside each image / clip
        pairs, kept = _attention_terms(wl.encoder_tokens[name], impl, False, c.num_heads)
        attn = 4 * pairs * d
    layer = Work(2 * n1 * (4 * d * d + 2 * d * f) + attn, d, 2 * n1 * d * ACT_BYTES,
                 ACT_BYTES * n1 * (10 * d + 2 * f) + kept, ACT_BYTES * n1 * d, bwd)
    if isinstance(c, VisionConfig):
        front = Work(2 * n1 * c.patch_dim * d, d, 0.0, ACT_BYTES * n1 * c.patch_dim, 0.0, bwd)
    else:  # conv1 over 2n frames, conv2 (stride 2) over n outputs
        front = Work(2 * 2 * n1 * c.num_mel_bins * 3 * d + 2 * n1 * 3 * d * d, d, 0.0,
                     ACT_BYTES * 2 * n1 * (c.num_mel_bins + 2 * d), 0.0, bwd)
    works = [layer] * (c.depth if isinstance(c, VisionConfig) else c.num_layers)
    works[0] = _merge(front, works[0])
    return works


def _projector_work(model: MLLMConfig, wl: Workload, name: str, bwd: int) -> Work:
    spec = model.encoder(name)
    p, e, out = spec.projector, spec.encoder.hidden_size, model.llm.hidden_size
    n1, _ = wl.encoder_moments(name)
    if p.kind == "mlp":
        dims = _mlp_dims(p, e, out)
        flops = 2 * (n1 / p.downsample) * sum(a * b for a, b in zip(dims[:-1], dims[1:]))
        acts = ACT_BYTES * (n1 / p.downsample) * sum(dims)
    else:
        q, h = p.num_queries, p.hidden_size or out
        count = wl.mean_segments(name)  # nq queries per image / clip
        flops = (2 * q * count * 2 * e * e + 2 * n1 * 2 * e * e + 4 * q * n1 * e
                 + 2 * q * count * (e * h + h * out))
        acts = ACT_BYTES * (q * count * (4 * e + h) + n1 * 2 * e)
    return Work(flops, out, 0.0, acts, 0.0, bwd)


def _generator_work(model: MLLMConfig, wl: Workload, bwd: int) -> list[Work]:
    g, c = model.generator, model.llm.hidden_size
    d, f, pd, n, m = g.hidden_size, g.ffn_size, g.patch_dim, g.num_patches, wl.cond_tokens
    k = wl.mean_generated()
    block = Work(k * (2 * n * (6 * d * d + 2 * d * f) + 2 * m * 2 * d * d + 2 * 6 * d * d
                      + 4 * n * n * d + 4 * n * m * d), d, k * 4 * n * d * ACT_BYTES,
                 ACT_BYTES * k * (n * (16 * d + 2 * f) + m * 2 * d), ACT_BYTES * k * n * d, bwd)
    front = Work(k * (2 * n * pd * d + 2 * m * c * d + 2 * (256 * d + d * d)), d, 0.0,
                 ACT_BYTES * k * (n * pd + m * c), 0.0, bwd)
    back = Work(k * (2 * n * d * pd + 2 * 2 * d * d), d, 0.0, ACT_BYTES * k * n * pd, 0.0, bwd)
    works = [block] * g.num_layers
    works[0] = _merge(front, works[0])
    works[-1] = _merge(works[-1], back)
    return works


def _merge(a: Work, b: Work) -> Work:
    return Work(a.flops + b.flops, max(a.width, b.width), a.allreduce_bytes + b.allreduce_bytes,
                a.act_bytes + b.act_bytes, a.in_bytes + b.in_bytes, max(a.bwd, b.bwd))


def impl_of(attention_impl, unit: str) -> str | None:
    """The implementation costed for `unit`: None (exact pairs), one name, or a dict."""
    if isinstance(attention_impl, dict):
        return attention_impl.get(unit)
    return attention_impl


def unit_work(model: MLLMConfig, wl: Workload, unit: str, attention_impl=None) -> UnitWork:
    """Per-layer forward work of `unit` for one average sample of `wl`; attention_impl (one
    name or {unit: name}) costs attention by that implementation's tiles."""
    impl = impl_of(attention_impl, unit)
    bwd = module_backward_factors(model)
    params = module_params(model)
    if unit == "llm":
        c = model.llm
        return UnitWork(unit, tuple(_llm_work(model, wl, bwd["llm"], impl)), (), params["llm"],
                        0 if model.llm_frozen else params["llm"],
                        ACT_BYTES * wl.llm_moments()[0] * c.hidden_size,
                        (c.num_heads, c.num_kv_heads, c.ffn_size))
    if unit == "generator":
        g = model.generator
        if g is None:
            raise ValueError(f"model {model.name!r} has no generator unit")
        return UnitWork(unit, tuple(_generator_work(model, wl, bwd["generator"])), (),
                        params["generator"], 0 if model.generator_frozen else params["generator"],
                        ACT_BYTES * wl.mean_generated() * g.num_patches * g.hidden_size,
                        (g.num_heads, g.ffn_size))
    spec = model.encoder(unit)
    proj = _projector_work(model, wl, unit, bwd[f"{unit}.projector"])
    trainable = ((0 if spec.frozen else params[unit])
                 + (0 if spec.projector_frozen else params[f"{unit}.projector"]))
    return UnitWork(unit, tuple(_encoder_work(model, wl, unit, bwd[unit], impl)), (proj,),
                    params[unit] + params[f"{unit}.projector"], trainable,
                    ACT_BYTES * wl.encoder_moments(unit)[0] * spec.encoder.hidden_size,
                    (spec.encoder.num_heads, spec.encoder.ffn_size))


# ---- time and memory ----------------------------------------------------------------------
def work_time(w: Work, tp: int, hw: Hardware, recompute: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one piece at tensor-parallel size `tp`."""
    fwd = w.flops / (tp * hw.peak_flops * hw.efficiency(w.width / tp))
    comm = 0.0 if tp == 1 else 2 * (tp - 1) / tp * w.allreduce_bytes / hw.nvlink_bw
    fwd += comm
    bwd = w.bwd * fwd + (fwd if recompute and w.bwd > 0 else 0.0)
    return fwd, bwd


def work_activation(w: Work, tp: int, recompute: bool = False) -> float:
    """Bytes kept for backward per GPU of a TP group (0 when no backward runs)."""
    if w.bwd == 0:
        return 0.0
    return (w.in_bytes if recompute else w.act_bytes) / tp


def layer_times(uw: UnitWork, tp: int, hw: Hardware, recompute: bool = False
                ) -> list[tuple[float, float]]:
    """(forward, backward) seconds per layer; the last layer carries the projector."""
    out = [work_time(w, tp, hw, recompute) for w in uw.layers]
    for w in uw.extra:
        f, b = work_time(w, 1, hw, recompute)
        out[-1] = (out[-1][0] + f, out[-1][1] + b)
    return out


@dataclass(frozen=True)
class UnitCost:
    """What the orchestrator needs to know about one unit (all per average sample).

    time_s[tp] = C(tp): forward + backward seconds of the whole unit for one sample,
    TP communication included (DistTrain §5.1)."""

    name: str
    num_layers: int
    time_s: dict[int, float]
    weight_bytes: float  # bf16 weights + fp32 grads of the whole unit (sharded by TP x PP)
    optimizer_bytes: float  # ZeRO-1 state of the whole unit (sharded by TP x PP x DP)
    activation_bytes: dict[int, float]  # tp -> one sample, whole unit, per GPU
    boundary_bytes: float  # stage-to-stage tensor for one sample
    grad_bytes: float  # gradient bytes synchronised over DP per iteration (0 if frozen)
    flops: float  # model FLOPs per sample (forward + required backward)
    layer_pp_divides: bool = False  # PP must divide num_layers (the LLM, DistTrain §5.2)
    fwd_s: dict[int, float] = field(default_factory=dict)


def unit_cost(model: MLLMConfig, wl: Workload, unit: str, hw: Hardware,
              recompute: bool = False, tp_sizes=TP_SIZES, attention_impl=None) -> UnitCost:
    uw = unit_work(model, wl, unit, attention_impl)
    tps = [t for t in tp_sizes if t <= hw.gpus_per_node and all(s % t == 0 for s in uw.tp_divides)]
    times, fwds, acts = {}, {}, {}
    for t in tps:
        lt = layer_times(uw, t, hw, recompute)
        times[t] = sum(f + b for f, b in lt)
        fwds[t] = sum(f for f, _ in lt)
        acts[t] = (sum(work_activation(w, t, recompute) for w in uw.layers)
                   + sum(work_activation(w, 1, recompute) for w in uw.extra))
    flops = sum(w.flops * (1 + w.bwd) for w in uw.layers + uw.extra)
    return UnitCost(name=unit, num_layers=len(uw.layers), time_s=times,
                    weight_bytes=WEIGHT_BYTES * uw.params + GRAD_BYTES * uw.trainable_params,
                    optimizer_bytes=OPTIMIZER_BYTES * uw.trainable_params,
                    activation_bytes=acts, boundary_bytes=uw.boundary_bytes,
                    grad_bytes=2.0 * uw.trainable_params, flops=flops,
                    layer_pp_divides=(unit == "llm"), fwd_s=fwds)


def unit_costs(model: MLLMConfig, wl: Workload, hw: Hardware, recompute: bool = False,
               attention_impl=None) -> tuple[UnitCost, ...]:
    """One `UnitCost` per unit, in `model.unit_names` order."""
    return tuple(unit_cost(model, wl, u, hw, recompute, attention_impl=attention_impl)
                 for u in model.unit_names)
