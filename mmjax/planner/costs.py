"""Analytic cost model of every unit (no JAX): parameters, FLOPs, time, memory, traffic.

- Parameters follow the Flax modules' layout exactly (`num_params`).
- Forward FLOPs per sample: 2 x tokens x matmul weights, plus the attention quadratic term
  summed over a sample's subsequences (DistTrain §2.3: sizes are skewed, so E[n^2] != E[n]^2).
  With an `attention_impl` (per unit) the LLM's and encoders' attention FLOPs and kept bytes
  come from the tiles that implementation computes (planner/attention_cost.py): the dense
  path pays every pair and keeps [S, S] float32 buffers, the tiled ones pay non-empty tiles
  and keep one float per row; without one, the exact allowed pairs and no [S, S] buffer.
  Sliding-window layers (`LLMConfig.is_sliding`: Mistral, Gemma 2/3's local layers) pay only
  the pairs / tiles inside their window, so a local/global pattern gives per-layer costs;
  Qwen2.5-VL's window blocks pay their windows' pairs (exact-pair costing only: mmjax keeps
  patches in image order, so the tiled kernels' tiles over interleaved windows stay full).
- Backward time follows Cornstarch's rule (Cornstarch §4.2): 0 x forward for a frozen module
  with nothing trainable before it, 1 x (input gradients only) for a frozen module with a
  trainable module before it, 2 x for a trainable module; activation recomputation adds one
  forward where a backward runs.
- Memory per GPU (DistTrain §5.1) as the runtime holds it (planner/memory.py): the compute
  copy, fp32 per-rank gradient accumulators and fp32 frozen weights on one TP rank (Megatron
  rules split all but `replicated_params`) / PP, fp32 master + AdamW moments also / DP
  (ZeRO-1), the residuals of the microbatches 1F1B keeps in flight under the unit's remat
  policy, one microbatch's backward working set, and the optimizer step.
- Activation recomputation (`remat`, pipeline/stage.py `remat_wrap`): "full" re-runs the
  forward in the backward; "dots" (Megatron selective recomputation, Korthikanti et al.
  §4.2) re-runs all but the weight matmuls, i.e. pays the attention core again; "none"
  recomputes nothing.
- Communication is volume / bandwidth: TP all-reduces inside C(TP), PP point-to-point of
  one boundary tensor, DP reduce-scatter + all-gather of gradients/parameters.

`unit_costs(model, workload, hw)` reduces all of it to one `UnitCost` per unit; the
orchestrator only sees `UnitCost`s (and `profile.py` can replace their times by measured
piecewise-linear tables).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mmjax.models.config import (AudioConfig, GeneratorConfig, LLMConfig, MLLMConfig,
                                 ProjectorConfig, VisionConfig)
from mmjax.planner import memory
from mmjax.models.qwen2_vl_config import full_attention_layer, window_patches
from mmjax.planner.attention_cost import (computed_pairs, exact_pairs, image_window_pairs,
                                          kept_bytes_per_head)
from mmjax.planner.hardware import Hardware
from mmjax.planner.workload import Workload
from mmjax.models.units import is_generator, is_llm, is_vae
from mmjax.planner.vae_placement import vae_encoder_flops, vae_params

TP_SIZES = (1, 2, 4, 8)
WEIGHT_BYTES = 2  # bf16 compute copy
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
    if c.kind == "qwen2_vl":  # no positions; norms with(out) bias; gated MLP (Qwen2.5-VL)
        f, nb = c.ffn_size, 2 if c.norm == "layer" else 1
        mlp = 3 * d * f + 2 * f + d if c.gated_mlp else 2 * d * f + f + d
        layer = 2 * nb * d + 3 * d * d + 3 * d + d * d + d + mlp
        return c.patch_dim * d + c.depth * layer + nb * d
    return (c.patch_dim * d + d * c.patch_bias + c.num_positions * d + d * c.class_token
            + 2 * d * c.pre_norm + layers + 2 * d * c.final_norm)


def audio_params(c: AudioConfig) -> int:
    d = c.hidden_size
    return (c.num_mel_bins * 3 * d + d + d * 3 * d + d + c.max_source_positions * d
            + c.num_layers * (_encoder_layer_params(d, c.ffn_size) - d) + 2 * d)  # no k bias


def _mlp_dims(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> list[int]:
    """Widths of an "mlp" or "patch_merger" projector (the merger's hidden: r * enc_dim)."""
    h = p.hidden_size or (enc_dim * p.downsample if p.kind == "patch_merger" else llm_dim)
    return [enc_dim * p.downsample] + [h] * (p.num_layers - 1) + [llm_dim]


def projector_params(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> int:
    if p.kind in ("mlp", "patch_merger"):
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
    attn_flops: float = 0.0  # the attention core's share of `flops` (what "dots" re-runs)
    tokens: float = 0.0  # mean tokens of one sample through this piece (measured profiles)
    kind: str = "gelu_full"  # layer kind a measured profile prices it as (hardware_profile)


@dataclass(frozen=True)
class UnitWork:
    name: str
    layers: tuple[Work, ...]  # one entry per layer (pre/post work folded into first/last)
    extra: tuple[Work, ...]  # pieces on the last stage (projector) with their own bwd factor
    params: int
    trainable_params: int
    boundary_bytes: float  # output of one layer for one sample (p2p volume)
    tp_divides: tuple[int, ...]  # sizes TP must divide


def _attention_terms(sizes, impl: str, causal: bool, heads: int,
                     window: int | None = None) -> tuple[float, float]:
    """Mean over samples of (computed pairs, kept attention bytes of all heads); sizes: per
    sample, the lengths of its attention segments; `window`: a causal sliding window."""
    pairs = np.mean([sum(computed_pairs(n, impl, causal, window) for n in s) for s in sizes])
    kept = np.mean([sum(kept_bytes_per_head(n, impl) for n in s) for s in sizes]) * heads
    return float(pairs), float(kept)


def _llm_layer(model: MLLMConfig, wl: Workload, bwd: int, impl: str | None,
               window: int | None) -> Work:
    """One decoder layer; `window`: its sliding window (None: global causal attention)."""
    c = model.llm
    d, hd, h, kv, f = c.hidden_size, c.dim_per_head, c.num_heads, c.num_kv_heads, c.ffn_size
    n1, n2 = wl.llm_moments()
    w = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
    attn = 2 * n2 * h * hd  # exact causal pairs: half of 4 n^2 h hd
    if window is not None:  # exact pairs inside the window
        attn = 4 * h * hd * float(np.mean([exact_pairs(n, True, window) for n in wl.llm_tokens]))
    kept = 0.0
    if impl is not None:
        pairs, kept = _attention_terms([(n,) for n in wl.llm_tokens], impl, True, h, window)
        attn = 4 * pairs * h * hd
    return Work(flops=2 * n1 * w + attn, width=d, allreduce_bytes=2 * n1 * d * ACT_BYTES,
                act_bytes=ACT_BYTES * n1 * (10 * d + 3 * f) + kept, in_bytes=ACT_BYTES * n1 * d,
                bwd=bwd, attn_flops=attn, tokens=n1, kind="gated_causal")


def _llm_work(model: MLLMConfig, wl: Workload, bwd: int, impl: str | None = None) -> list[Work]:
    c = model.llm
    n1, _ = wl.llm_moments()
    d, v = c.hidden_size, c.vocab_size
    local = _llm_layer(model, wl, bwd, impl, c.sliding_window) if c.sliding_window else None
    glob = _llm_layer(model, wl, bwd, impl, None)
    head = Work(2 * n1 * d * v, d, 0.0, ACT_BYTES * n1 * v, 0.0, bwd, tokens=n1,
                kind="gated_causal")
    works = [local if c.is_sliding(i) else glob for i in range(c.num_layers)]
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
    mats = 3 if getattr(c, "gated_mlp", False) else 2  # Qwen2.5-VL's gate / up / down
    make = lambda a: Work(2 * n1 * (4 * d * d + mats * d * f) + a, d, 2 * n1 * d * ACT_BYTES,
                          ACT_BYTES * n1 * (10 * d + 2 * f) + kept, ACT_BYTES * n1 * d, bwd, a,
                          tokens=n1)
    layer = make(attn)
    side = window_patches(c) if getattr(c, "kind", None) == "qwen2_vl" else 0
    if side and impl is None:  # Qwen2.5-VL: window blocks pay their windows' exact pairs
        win = make(4 * d * float(np.mean([sum(image_window_pairs(n, side) for n in s)
                                          for s in wl.encoder_tokens[name]])))
        works = [layer if full_attention_layer(c, i) else win for i in range(c.depth)]
    else:  # the tiled kernels: windows interleave in patch order, their tiles stay full
        works = [layer] * (c.depth if isinstance(c, VisionConfig) else c.num_layers)
    if isinstance(c, VisionConfig):
        front = Work(2 * n1 * c.patch_dim * d, d, 0.0, ACT_BYTES * n1 * c.patch_dim, 0.0, bwd,
                     tokens=n1)
    else:  # conv1 over 2n frames, conv2 (stride 2) over n outputs
        front = Work(2 * 2 * n1 * c.num_mel_bins * 3 * d + 2 * n1 * 3 * d * d, d, 0.0,
                     ACT_BYTES * 2 * n1 * (c.num_mel_bins + 2 * d), 0.0, bwd, tokens=n1)
    works[0] = _merge(front, works[0])
    return works


def _projector_work(model: MLLMConfig, wl: Workload, name: str, bwd: int) -> Work:
    spec = model.encoder(name)
    p, e, out = spec.projector, spec.encoder.hidden_size, model.llm.hidden_size
    n1, _ = wl.encoder_moments(name)
    if p.kind in ("mlp", "patch_merger"):
        dims = _mlp_dims(p, e, out)
        flops = 2 * (n1 / p.downsample) * sum(a * b for a, b in zip(dims[:-1], dims[1:]))
        acts = ACT_BYTES * (n1 / p.downsample) * sum(dims)
    else:
        q, h = p.num_queries, p.hidden_size or out
        count = wl.mean_segments(name)  # nq queries per image / clip
        flops = (2 * q * count * 2 * e * e + 2 * n1 * 2 * e * e + 4 * q * n1 * e
                 + 2 * q * count * (e * h + h * out))
        acts = ACT_BYTES * (q * count * (4 * e + h) + n1 * 2 * e)
    return Work(flops, out, 0.0, acts, 0.0, bwd, tokens=n1 / p.downsample if p.kind == "mlp"
                else n1)


def _generator_work(model: MLLMConfig, wl: Workload, bwd: int) -> list[Work]:
    g, c = model.generator, model.llm.hidden_size
    d, f, pd, n, m = g.hidden_size, g.ffn_size, g.patch_dim, g.num_patches, wl.cond_tokens
    k = wl.mean_generated()
    block = Work(k * (2 * n * (6 * d * d + 2 * d * f) + 2 * m * 2 * d * d + 2 * 6 * d * d
                      + 4 * n * n * d + 4 * n * m * d), d, k * 4 * n * d * ACT_BYTES,
                 ACT_BYTES * k * (n * (16 * d + 2 * f) + m * 2 * d), ACT_BYTES * k * n * d, bwd,
                 k * (4 * n * n * d + 4 * n * m * d), tokens=k * n)
    front = Work(k * (2 * n * pd * d + 2 * m * c * d + 2 * (256 * d + d * d)), d, 0.0,
                 ACT_BYTES * k * (n * pd + m * c), 0.0, bwd, tokens=k * n)
    back = Work(k * (2 * n * d * pd + 2 * 2 * d * d), d, 0.0, ACT_BYTES * k * n * pd, 0.0, bwd,
                tokens=k * n)
    works = [block] * g.num_layers
    works[0] = _merge(front, works[0])
    works[-1] = _merge(works[-1], back)
    return works


def _vae_side(model: MLLMConfig) -> int:
    """The pixels the VAE unit reads per target image (square)."""
    return model.generator.latent_size * model.vae.downsample


def _vae_work(model: MLLMConfig, wl: Workload, unit: str) -> UnitWork:
    """The frozen VAE unit: its encoder's FLOPs on the mean generated images of a sample,
    forward only (no backward factor); it hands the generator fp32 latents."""
    v, g = model.vae, model.generator
    k, side = wl.mean_generated(), _vae_side(model)
    flops = k * vae_encoder_flops(v.block_out_channels, v.layers_per_block, v.in_channels,
                                  v.latent_channels, side, v.mid_block_add_attention)
    latent = g.latent_channels * g.latent_size * g.latent_size
    work = Work(flops, max(v.block_out_channels), 0.0, 0.0, 0.0, 0,
                tokens=k * g.latent_size * g.latent_size)
    params = vae_params(v.block_out_channels, v.layers_per_block, v.in_channels,
                        v.latent_channels, v.out_channels, v.mid_block_add_attention,
                        v.use_quant_conv, v.use_post_quant_conv)
    return UnitWork(unit, (work,), (), params, 0, 4.0 * k * latent, ())


def _vae_acts(model: MLLMConfig, wl: Workload) -> memory.Acts:
    """Forward-only peak of the VAE unit for one sample: the widest conv's input and output
    at full resolution (fp32), the pixels in and the latents out."""
    v, k, side = model.vae, wl.mean_generated(), _vae_side(model)
    peak = 4.0 * k * side * side * 2 * v.block_out_channels[0] * 2
    latent = 4.0 * k * model.generator.latent_channels * model.generator.latent_size ** 2
    return memory.Acts(0.0, 0.0, peak, latent, 4.0 * k * side * side * 3)


def _merge(a: Work, b: Work) -> Work:
    return Work(a.flops + b.flops, max(a.width, b.width), a.allreduce_bytes + b.allreduce_bytes,
                a.act_bytes + b.act_bytes, a.in_bytes + b.in_bytes, max(a.bwd, b.bwd),
                a.attn_flops + b.attn_flops, max(a.tokens, b.tokens), b.kind)


def impl_of(attention_impl, unit: str) -> str | None:
    """The implementation costed for `unit`: None (exact pairs), one name, or a dict."""
    if isinstance(attention_impl, dict):
        return attention_impl.get(unit)
    return attention_impl


def unit_work(model: MLLMConfig, wl: Workload, unit: str, attention_impl=None) -> UnitWork:
    """Per-layer forward work of `unit` for one average sample of `wl`; attention_impl (one
    name or {unit: name}) costs attention by that implementation's tiles."""
    impl = impl_of(attention_impl, unit)
    if is_vae(unit):
        return _vae_work(model, wl, unit)
    bwd = module_backward_factors(model)
    params = module_params(model)
    if is_llm(unit):
        c = model.llm
        return UnitWork(unit, tuple(_llm_work(model, wl, bwd["llm"], impl)), (), params["llm"],
                        0 if model.llm_frozen else params["llm"],
                        ACT_BYTES * wl.llm_moments()[0] * c.hidden_size,
                        (c.num_heads, c.num_kv_heads, c.ffn_size))
    if is_generator(unit):
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
def remat_policy(recompute) -> str:
    """The runtime's remat policy for a `recompute` argument: a policy name, or a bool
    (True: "full", False: "none")."""
    if isinstance(recompute, str):
        if recompute not in memory.REMATS:
            raise ValueError(f"remat={recompute!r}: must be one of {list(memory.REMATS)}")
        return recompute
    return "full" if recompute else "none"


def work_time(w: Work, tp: int, hw: Hardware, recompute=False) -> tuple[float, float]:
    """(forward, backward) seconds of one piece at tensor-parallel size `tp`; `recompute`
    (a remat policy or a bool) adds what the backward re-runs: the whole forward ("full",
    Megatron full recomputation) or the attention core ("dots", Megatron selective
    recomputation: the weight matmuls' outputs are kept)."""
    eff = tp * hw.peak_flops * hw.efficiency(w.width / tp, w.tokens, w.kind)
    fwd = w.flops / eff
    comm = 0.0 if tp == 1 else 2 * (tp - 1) / tp * w.allreduce_bytes / hw.nvlink_bw
    fwd += comm
    policy = remat_policy(recompute)
    redo = fwd if policy == "full" else w.attn_flops / eff if policy == "dots" else 0.0
    bwd = w.bwd * fwd + (redo if w.bwd > 0 else 0.0)
    return fwd, bwd


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
    TP communication included (DistTrain §5.1). Memory terms as planner/memory.py
    `unit_stage_bytes` combines them (`evaluate.memory_bytes`); the defaults of the later
    fields leave the plain weights / optimizer / activations sum."""

    name: str
    num_layers: int
    time_s: dict[int, float]
    weight_bytes: float  # compute copy, fp32 accumulators and frozen weights, cotangents
    optimizer_bytes: float  # ZeRO-1 state of the whole unit (sharded by TP x PP x DP)
    activation_bytes: dict[int, float]  # tp -> kept residuals, one sample, whole unit, per GPU
    boundary_bytes: float  # stage-to-stage tensor for one sample
    grad_bytes: float  # gradient bytes synchronised over DP per iteration (0 if frozen)
    flops: float  # model FLOPs per sample (forward + required backward)
    layer_pp_divides: bool = False  # PP must divide num_layers (the LLM, DistTrain §5.2)
    fwd_s: dict[int, float] = field(default_factory=dict)
    remat: str = "none"  # the runtime's remat policy these times and bytes assume
    input_bytes: float = 0.0  # stage input kept per in-flight microbatch, one sample
    work_bytes: dict[int, float] = field(default_factory=dict)  # tp -> backward rebuilds
    fixed_bytes: dict[int, float] = field(default_factory=dict)  # tp -> score buffers, I/O
    step_weight_bytes: float | None = None  # optimizer step: compute copies, frozen
    replicated: float = 0.0  # fraction of the parameters TP does not split
    dtype_bytes: int = WEIGHT_BYTES  # compute dtype
    # policy -> this unit under that remat policy (none, dots, full): the planner picks per
    # choice the least recompute that fits (evaluate.remat_variant); {}: `remat` only
    variants: dict = field(default_factory=dict, compare=False, repr=False)
    # the orchestrator's in-flight count x this = the runtime's (build.py: an encoder's
    # first stage also holds the LLM's pipeline depth)
    flight_scale: float = 1.0


def replicated_params(model: MLLMConfig, unit: str) -> int:
    """Parameters of `unit` that Megatron TP leaves whole on every rank (parallel/tensor.py
    `megatron_role`): all but the blocks' q/k/v/o/fc1/fc2 (and cross-attention) matrices
    with their column biases, the LLM's projections and its vocabulary matrices."""
    params = module_params(model)
    if is_vae(unit):  # never split: tp = 1
        v = model.vae
        return vae_params(v.block_out_channels, v.layers_per_block, v.in_channels,
                          v.latent_channels, v.out_channels, v.mid_block_add_attention,
                          v.use_quant_conv, v.use_post_quant_conv)
    if is_llm(unit):
        c = model.llm
        return c.num_layers * 2 * c.hidden_size + c.hidden_size
    if is_generator(unit):
        g = model.generator
        d, f = g.hidden_size, g.ffn_size
        return params[unit] - g.num_layers * (8 * d * d + 6 * d + 2 * d * f + f)
    c = model.encoder(unit).encoder
    d, f = c.hidden_size, c.ffn_size
    biases = 2 if isinstance(c, AudioConfig) else 3  # Whisper's key has no bias
    layers = c.depth if isinstance(c, VisionConfig) else c.num_layers
    return (params[unit] + params[f"{unit}.projector"]
            - layers * (4 * d * d + biases * d + 2 * d * f + f))


def unit_acts(model: MLLMConfig, wl: Workload, unit: str, tp: int, impl: str | None,
              b: int = ACT_BYTES) -> memory.Acts:
    """planner/memory.py's activation bytes of one average sample through the whole unit
    at `tp`; `impl` None (exact pairs, no [S, S] buffer) is costed as a tiled kernel."""
    if is_vae(unit):
        return _vae_acts(model, wl)
    if is_llm(unit):
        n1, n2 = wl.llm_moments()
        return memory.llm_acts(model.llm, n1, n2, tp, b, impl)
    if is_generator(unit):
        return memory.generator_acts(model.generator, wl.mean_generated(), wl.cond_tokens, tp,
                                     b, cond_dim=model.llm.hidden_size, impl=impl)
    spec = model.encoder(unit)
    c, p = spec.encoder, spec.projector
    n1, n2 = wl.encoder_moments(unit)
    in_dim = c.patch_dim if isinstance(c, VisionConfig) else 2 * c.num_mel_bins
    out = (n1 / p.downsample if p.kind in ("mlp", "patch_merger")
           else p.num_queries * wl.mean_segments(unit))
    return memory.encoder_acts(c, n1, n2, tp, b, impl, in_dim, out, model.llm.hidden_size)


def unit_cost(model: MLLMConfig, wl: Workload, unit: str, hw: Hardware,
              recompute=False, tp_sizes=TP_SIZES, attention_impl=None) -> UnitCost:
    """`recompute`: the unit's remat policy ("none" / "dots" / "full"; a bool: True is
    "full", False "none"), which sets both the backward time and the memory terms."""
    remat = remat_policy(recompute)
    impl = impl_of(attention_impl, unit)
    uw = unit_work(model, wl, unit, attention_impl)
    tps = [t for t in tp_sizes if t <= hw.gpus_per_node and all(s % t == 0 for s in uw.tp_divides)]
    if is_vae(unit):  # runs whole on each device (planner/plan.py `_validate_vae`)
        tps = [1]
    backward = any(w.bwd for w in uw.layers + uw.extra)
    times, fwds, acts, work, fixed = {}, {}, {}, {}, {}
    b = ACT_BYTES
    for t in tps:
        lt = layer_times(uw, t, hw, remat)
        times[t] = sum(f + bb for f, bb in lt)
        fwds[t] = sum(f for f, _ in lt)
        a = unit_acts(model, wl, unit, t, impl, b)
        io = a.input + 2 * a.boundary
        if not backward:  # forward only: nothing kept, one layer's scores at a time
            acts[t], work[t], fixed[t] = 0.0, 0.0, a.scores + io
            continue
        acts[t] = a.kept(remat)
        work[t] = a.recomputed(remat)
        fixed[t] = (memory.SCORE_BUFFERS * a.scores if remat == "none" else 0.0) + io
    flops = sum(w.flops * (1 + w.bwd) for w in uw.layers + uw.extra)
    trainable, frozen = uw.trainable_params, uw.params - uw.trainable_params
    a1 = unit_acts(model, wl, unit, tps[0], impl, b) if tps else None
    return UnitCost(name=unit, num_layers=len(uw.layers), time_s=times,
                    weight_bytes=((2 * b + memory.ACC_BYTES) * trainable
                                  + memory.FROZEN_BYTES * frozen),
                    optimizer_bytes=memory.OPTIMIZER_BYTES * trainable,
                    activation_bytes=acts, boundary_bytes=uw.boundary_bytes,
                    grad_bytes=2.0 * uw.trainable_params, flops=flops,
                    layer_pp_divides=is_llm(unit), fwd_s=fwds, remat=remat,
                    input_bytes=a1.input if (a1 and backward and remat != "none") else 0.0,
                    work_bytes=work, fixed_bytes=fixed,
                    step_weight_bytes=2 * b * trainable + memory.FROZEN_BYTES * frozen,
                    replicated=replicated_params(model, unit) / max(uw.params, 1),
                    dtype_bytes=b)


def with_remat_variants(model: MLLMConfig, wl: Workload, unit: str, hw: Hardware,
                        attention_impl=None) -> UnitCost:
    """The unit's "none" cost carrying all three policies as `variants` (none, dots, full):
    its times are the fastest, and the planner picks per choice the least recompute that
    fits (DistTrain §5.2 memory constraint; Megatron selective before full recomputation)."""
    costs = {p: unit_cost(model, wl, unit, hw, p, attention_impl=attention_impl)
             for p in memory.REMATS}
    return dataclasses.replace(costs["none"], variants=costs)


def unit_costs(model: MLLMConfig, wl: Workload, hw: Hardware, recompute=False,
               attention_impl=None) -> tuple[UnitCost, ...]:
    """One `UnitCost` per unit, in `model.unit_names` order; `recompute`: one policy for
    every unit, {unit: policy}, or "auto" (each unit with its `with_remat_variants`)."""
    def one(u):
        r = recompute.get(u, False) if isinstance(recompute, dict) else recompute
        if r == "auto":
            return with_remat_variants(model, wl, u, hw, attention_impl)
        return unit_cost(model, wl, u, hw, r, attention_impl=attention_impl)
    return tuple(one(u) for u in model.unit_names)
