"""Hugging Face decoder config.json <-> `LLMConfig`, for every decoder family mmjax imports.

Both config layouts are read: transformers 4 (top-level `rope_theta`, a `rope_scaling` dict,
Gemma 3's `rope_local_base_freq`) and transformers 5 (`rope_parameters`, nested by layer type
for Gemma 3). Absent keys take the transformers 5 class defaults (Mistral's sliding_window
4096, Gemma 2's soft-caps 50 / 30, Gemma's query_pre_attn_scalar 256 ...). Sliding windows
follow transformers 5's `layer_types`: Mistral and Phi-3 slide every layer, Qwen2 / Qwen3
the layers >= max_window_layers when use_sliding_window, Gemma 2 every other layer and
Gemma 3 five of every six (sliding_window_pattern). Everything mmjax's decoder does not
compute is refused with one line naming the field.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NoReturn

from mmjax.models.config import LLMConfig
from mmjax.models.hf.checkpoint import read_config

LLM_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_LAYER_TYPES = ("sliding_attention", "full_attention")
_SUPPORTED = ", ".join(LLM_TYPES)


def _refuse(field: str, value, why: str) -> NoReturn:
    raise ValueError(f"config.json {field}={value!r}: {why}")


def _scaling(p: dict, c: dict, where: str) -> tuple | None:
    """One flat RoPE parameter dict -> `LLMConfig.rope_scaling` (as transformers 5's
    `ROPE_INIT_FUNCTIONS` read it)."""
    kind = p.get("rope_type", p.get("type", "default"))
    if kind not in ROPE_TYPES:
        _refuse(f"{where}.rope_type", kind, f"mmjax models RoPE types {', '.join(ROPE_TYPES)}")
    partial = p.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse("partial_rotary_factor", partial, "mmjax's decoder rotates the whole head (1.0)")
    if kind == "default":
        return None
    if kind == "linear":
        return ("linear", float(p["factor"]))
    original = (p.get("original_max_position_embeddings")
                or c.get("original_max_position_embeddings") or c.get("max_position_embeddings"))
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS[:3] if k not in p]
        if missing or original is None:
            _refuse(f"{where}.rope_type", kind, f"llama3 scaling needs {missing or _LLAMA3_KEYS[3:]}")
        return ("llama3", float(p["factor"]), float(p["low_freq_factor"]),
                float(p["high_freq_factor"]), int(original))
    if original is None:
        _refuse(f"{where}.rope_type", kind, "yarn scaling needs original_max_position_embeddings "
                "or max_position_embeddings")
    factor = p.get("factor")
    factor = c["max_position_embeddings"] / original if factor is None else float(factor)
    attn = p.get("attention_factor")
    mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
    get = lambda s, m=1: 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    if attn is None:
        attn = get(factor, mscale) / get(factor, mscale_all) if mscale and mscale_all else get(factor)
    return ("yarn", float(factor), int(original), float(p.get("beta_fast") or 32),
            float(p.get("beta_slow") or 1), float(attn), bool(p.get("truncate", True)))


def rope_from_hf(c: dict) -> tuple[float, tuple | None]:
    """(rope_theta, `LLMConfig.rope_scaling`) of the (global) layers, from either layout."""
    return _rope(c, c.get("model_type"))[:2]


def _rope(c: dict, kind) -> tuple[float, tuple | None, float | None]:
    """(theta, scaling, local theta or None) from either layout."""
    params = dict(c.get("rope_parameters") or {})
    legacy = c.get("rope_scaling") or {}
    default_theta = 1e6 if kind == "gemma3_text" else 10000.0
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    local = None
    if nested:
        if kind != "gemma3_text" or set(nested) - set(_LAYER_TYPES):
            _refuse("rope_parameters", sorted(nested), "per-layer-type RoPE is read for "
                    "gemma3_text's sliding_attention / full_attention only")
        loc = nested.get("sliding_attention") or {}
        if _scaling(loc, c, "rope_parameters.sliding_attention") is not None:
            _refuse("rope_parameters.sliding_attention.rope_type", loc.get("rope_type"),
                    "mmjax's local layers use plain RoPE ('default')")
        local = float(loc.get("rope_theta", c.get("rope_local_base_freq", 10000.0)))
        params = dict(nested.get("full_attention") or {})
    elif kind == "gemma3_text":
        local = float(c.get("rope_local_base_freq", 10000.0))
    theta = params.get("rope_theta", c.get("rope_theta", default_theta))
    if "rope_theta" in params and "rope_theta" in c and float(c["rope_theta"]) != float(theta):
        _refuse("rope_theta", c["rope_theta"], f"differs from rope_parameters.rope_theta={theta}; "
                "keep one")
    flat = params if params.get("rope_type", "default") != "default" else dict(legacy)
    flat.setdefault("partial_rotary_factor",
                    params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    where = "rope_parameters" if flat is params else "rope_scaling"
    if kind == "phi3" and flat.get("rope_type", flat.get("type")) in ("su", "yarn", "longrope"):
        _refuse(f"{where}.rope_type", flat.get("rope_type", flat.get("type")),
                "Phi-3 reads this as 'longrope', which mmjax does not model (use a 4k-context "
                "Phi-3 checkpoint: rope_scaling null)")
    return float(theta), _scaling(flat, c, where), local


def _window(c: dict, kind: str | None) -> tuple[int | None, tuple[bool, ...] | None]:
    """(sliding_window or None, per-layer flags or None for every layer)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types")
    if kind == "mistral":
        window, types = c.get("sliding_window", 4096), None
    elif kind == "phi3":
        window, types = c.get("sliding_window"), None
    elif kind in ("qwen2", "qwen3"):
        window = c.get("sliding_window", 4096) if c.get("use_sliding_window") else None
        if types is None and window is not None:
            start = c.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(n)]
    elif kind in GEMMA:
        window = c.get("sliding_window", 4096)
        every = 2 if kind == "gemma2" else c.get("sliding_window_pattern", 6)
        if types is None:
            types = ["sliding_attention" if (i + 1) % every else "full_attention"
                     for i in range(n)]
    else:
        return None, None
    flags: tuple[bool, ...] | None
    if types is not None:
        if len(types) != n or set(types) - set(_LAYER_TYPES):
            _refuse("layer_types", types, f"give {n} entries, each one of {list(_LAYER_TYPES)}")
        flags = tuple(t == "sliding_attention" for t in types)
        if not any(flags):
            return None, None
        if window is not None and all(flags):
            flags = None
    else:
        flags = None
    if window is None and kind == "gemma3_text" and types is not None:
        _refuse("sliding_window", None, "gemma3_text's sliding layers need a window (their "
                "local RoPE is modelled with it)")
    return (None, None) if window is None else (int(window), flags)


def _check(c: dict, kind) -> str:
    experts = next((k for k in ("num_local_experts", "num_experts") if c.get(k)), None)
    if experts or kind == "mixtral":
        key = experts or "num_local_experts"
        _refuse(key, c.get(key), f"mixture-of-experts layers (model_type {kind!r}) are not "
                f"in mmjax; supported dense LLMs: {_SUPPORTED}")
    if kind not in LLM_TYPES:
        _refuse("model_type", kind, f"supported LLMs: {_SUPPORTED}")
    field = "hidden_activation" if kind in GEMMA else "hidden_act"
    act = c.get(field, "gelu_pytorch_tanh" if kind in GEMMA else "silu")
    if act not in _ACTS:
        _refuse(field, act, "mmjax's decoder computes silu or gelu_pytorch_tanh")
    for f in ("attention_bias", "mlp_bias"):
        if c.get(f):
            _refuse(f, c[f], "mmjax's decoder has biases only on q/k/v, for qwen2")
    if c.get("use_bidirectional_attention"):
        _refuse("use_bidirectional_attention", True, "mmjax's decoder is causal")
    return _ACTS[act]


def config_from_hf(config) -> LLMConfig:
    """HF decoder config.json (path, checkpoint directory or dict) -> LLMConfig. Features
    mmjax's decoder lacks raise ValueError naming the field instead of loading a model
    that would silently compute something else."""
    c = read_config(config)
    kind = c.get("model_type")
    act = _check(c, kind)
    theta, scaling, local_theta = _rope(c, kind)
    window, flags = _window(c, kind)
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim", 256 if kind in GEMMA else None)
    gemma = kind in GEMMA
    get = lambda key, default: c.get(key, default) if gemma else None
    qpas = get("query_pre_attn_scalar", 256)
    cfg = LLMConfig(
        vocab_size=c["vocab_size"], hidden_size=d, num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        ffn_size=c["intermediate_size"],
        head_dim=None if head_dim in (None, d // heads) else head_dim,
        rope_theta=theta, rope_scaling=scaling,
        tie_embeddings=bool(c.get("tie_word_embeddings", gemma)),
        qkv_bias=kind == "qwen2", norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        qk_norm=kind in ("qwen3", "gemma3_text"), gemma_norms=gemma, sandwich_norms=gemma,
        embed_scale=gemma, mlp_act=act,
        attn_scale=None if qpas is None else float(qpas) ** -0.5,
        # Gemma 3's attention has no soft-cap in transformers, whatever its config says
        attn_softcap=get("attn_logit_softcapping", 50.0) if kind == "gemma2" else None,
        final_softcap=get("final_logit_softcapping", 30.0 if kind == "gemma2" else None),
        sliding_window=window, sliding_layers=flags,
        rope_local_theta=local_theta if window is not None else None)
    # the family is recorded only where the options do not imply it (Phi-3, a Mistral
    # without a window), so configs of the other families compare equal to mmjax's own
    return cfg if _infer_type(cfg) == kind else dataclasses.replace(cfg, hf_type=kind)


def _infer_type(cfg: LLMConfig) -> str:
    if cfg.hf_type:
        return cfg.hf_type
    if cfg.sandwich_norms:
        return "gemma3_text" if cfg.qk_norm else "gemma2"
    if cfg.qk_norm:
        return "qwen3"
    if cfg.qkv_bias:
        return "qwen2"
    return "mistral" if cfg.sliding_window is not None else "llama"


def _scaling_to_hf(s: tuple) -> dict:
    kind, *p = s
    if kind == "linear":
        return {"rope_type": "linear", "factor": p[0]}
    if kind == "llama3":
        return dict(zip(_LLAMA3_KEYS, p), rope_type="llama3")
    keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "attention_factor", "truncate")
    return dict(zip(keys, p), rope_type="yarn")


def config_to_hf(cfg: LLMConfig) -> dict:
    """LLMConfig -> HF config.json dict of the family it came from (`hf_type`, else inferred),
    transformers 4 layout (transformers 5 reads it too)."""
    kind = _infer_type(cfg)
    out = {
        "architectures": [ARCHITECTURES[kind]], "model_type": kind,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size,
        "head_dim": cfg.dim_per_head, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "rms_norm_eps": cfg.norm_eps,
    }
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.mlp_act]
    out["hidden_activation" if kind in GEMMA else "hidden_act"] = act
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = _scaling_to_hf(cfg.rope_scaling)
        if cfg.rope_scaling[0] == "yarn":  # the context YaRN extends to (transformers checks)
            out["max_position_embeddings"] = int(cfg.rope_scaling[1] * cfg.rope_scaling[2])
    if cfg.rope_local_theta is not None:
        out["rope_local_base_freq"] = cfg.rope_local_theta
    if kind in GEMMA:
        qpas = round((cfg.attn_scale or cfg.dim_per_head ** -0.5) ** -2, 6)
        out["query_pre_attn_scalar"] = int(qpas) if qpas == int(qpas) else qpas
        out["attn_logit_softcapping"] = cfg.attn_softcap
        out["final_logit_softcapping"] = cfg.final_softcap
    out["sliding_window"] = cfg.sliding_window
    if kind in ("qwen2", "qwen3"):
        out["use_sliding_window"] = cfg.sliding_window is not None
        out["max_window_layers"] = next((i for i in range(cfg.num_layers) if cfg.is_sliding(i)),
                                        cfg.num_layers)
    if kind == "phi3":
        # the class defaults (32000) may lie outside a small vocabulary
        out["pad_token_id"] = out["eos_token_id"] = None
    if kind in GEMMA + ("qwen2", "qwen3"):
        out["layer_types"] = ["sliding_attention" if cfg.is_sliding(i) else "full_attention"
                              for i in range(cfg.num_layers)]
    return out
