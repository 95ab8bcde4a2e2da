"""Per-layer forward work of each unit for one average sample (no JAX): FLOPs, the attention
quadratic term summed over a sample's subsequences (DistTrain §2.3: sizes are skewed, so
E[n^2] != E[n]^2; with an `attention_impl` the tiles that implementation computes,
planner/attention_cost.py), TP all-reduce volume, kept activation bytes, and each piece's
backward factor under Cornstarch's frozen rule (Cornstarch §4.2). planner/costs.py turns it
into times and bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np

from mmjax.models.config import MLLMConfig, VisionConfig
from mmjax.models.qwen2_vl_config import full_attention_layer, window_patches
from mmjax.models.units import is_generator, is_llm, is_vae
from mmjax.planner.attention_cost import (computed_pairs, exact_pairs, image_window_pairs,
                                          kept_bytes_per_head)
from mmjax.planner.module_params import mlp_dims, module_params
from mmjax.planner.vae_placement import vae_encoder_flops, vae_params
from mmjax.planner.lora_params import lora_flops, lora_params
from mmjax.planner.workload import Workload

ACT_BYTES = 2  # bf16 activations


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
    for part in model.lora_units():  # base frozen, adapters trained: activation gradients
        out[part] = 1
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
    return Work(flops=2 * n1 * w + attn + lora_flops(model, "llm", n1), width=d, allreduce_bytes=2 * n1 * d * ACT_BYTES,
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
    # a sliding layer only with a sliding window, where `local` is built
    works = [cast(Work, local) if c.is_sliding(i) else glob for i in range(c.num_layers)]
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
        assert isinstance(c, VisionConfig)  # kind 'qwen2_vl' is a vision encoder
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
        dims = mlp_dims(p, e, out)
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
    assert g is not None  # the model has a generator unit
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


def vae_side(model: MLLMConfig) -> int:
    """The pixels the VAE unit reads per target image (square)."""
    g, v = model.generator, model.vae
    assert g is not None and v is not None  # the model has a VAE unit feeding its generator
    return g.latent_size * v.downsample


def _vae_work(model: MLLMConfig, wl: Workload, unit: str) -> UnitWork:
    """The frozen VAE unit: its encoder's FLOPs on the mean generated images of a sample,
    forward only (no backward factor); it hands the generator fp32 latents."""
    v, g = model.vae, model.generator
    assert v is not None and g is not None  # the model has a VAE unit feeding its generator
    k, side = wl.mean_generated(), vae_side(model)
    flops = k * vae_encoder_flops(v.block_out_channels, v.layers_per_block, v.in_channels,
                                  v.latent_channels, side, v.mid_block_add_attention)
    latent = g.latent_channels * g.latent_size * g.latent_size
    work = Work(flops, max(v.block_out_channels), 0.0, 0.0, 0.0, 0,
                tokens=k * g.latent_size * g.latent_size)
    params = vae_params(v.block_out_channels, v.layers_per_block, v.in_channels,
                        v.latent_channels, v.out_channels, v.mid_block_add_attention,
                        v.use_quant_conv, v.use_post_quant_conv)
    return UnitWork(unit, (work,), (), params, 0, 4.0 * k * latent, ())


def _merge(a: Work, b: Work) -> Work:
    return Work(a.flops + b.flops, max(a.width, b.width), a.allreduce_bytes + b.allreduce_bytes,
                a.act_bytes + b.act_bytes, a.in_bytes + b.in_bytes, max(a.bwd, b.bwd),
                a.attn_flops + b.attn_flops, max(a.tokens, b.tokens), b.kind)


def impl_of(attention_impl, unit: str) -> str | None:
    """The implementation costed for `unit`: None (exact pairs), one name, or a dict."""
    if isinstance(attention_impl, dict):
        return attention_impl.get(unit)
    return attention_impl


def _trained(model: MLLMConfig, part: str, params: dict, frozen: bool) -> int:
    """The parameters of `part` that train: its adapters when LoRA'd, else all or none."""
    if part in model.lora_units():
        return lora_params(model, part)
    return 0 if frozen else params[part]


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
                        _trained(model, "llm", params, model.llm_frozen),
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
    trainable = (_trained(model, unit, params, spec.frozen)
                 + _trained(model, f"{unit}.projector", params, spec.projector_frozen))
    return UnitWork(unit, tuple(_encoder_work(model, wl, unit, bwd[unit], impl)), (proj,),
                    params[unit] + params[f"{unit}.projector"], trainable,
                    ACT_BYTES * wl.encoder_moments(unit)[0] * spec.encoder.hidden_size,
                    (spec.encoder.num_heads, spec.encoder.ffn_size))
