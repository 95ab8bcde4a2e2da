"""Hugging Face decoder LLMs (Llama 2 / 3 / 3.1 / 3.2, Mistral, Qwen2 / 2.5) <-> `models.llm.LLM`.

RoPE: HF's modelling code uses the rotate-half convention, like `layers.rope` (first half
x1*cos - x2*sin, second half x2*cos + x1*sin), so q/k weights need no permutation. RoPE
settings are read from either config layout: transformers 4 (top-level `rope_theta`, a
`rope_scaling` dict) and transformers 5 (`rope_parameters` with `rope_theta` and `rope_type`);
`llama3` scaling is modelled exactly (`layers.rope_inv_freq`), anything else is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmjax.models.config import LLMConfig
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, layer_range,
                                        module_pure, read_config, save_entries)

LLM_TYPES = ("llama", "mistral", "qwen2")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llm_entries(cfg: LLMConfig, start: int = 0, end: int | None = None) -> list[Entry]:
    """HF Llama/Qwen2 names for the parameters of `LLM(cfg, key, start, end)`."""
    start, end = layer_range(cfg.num_layers, start, end, "LLM")
    d, v, f = cfg.hidden_size, cfg.vocab_size, cfg.ffn_size
    hq, hkv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    is_first, is_last = start == 0, end == cfg.num_layers
    out = []
    if is_first or (is_last and cfg.tie_embeddings):
        out.append(Entry("model.embed_tokens.weight", ("embed",), (v, d)))
    for i in range(start, end):
        p, j = f"model.layers.{i}.", i - start
        out += [
            Entry(p + "input_layernorm.weight", ("layers", j, "attn_norm", "scale"), (d,)),
            Entry(p + "self_attn.q_proj.weight", ("layers", j, "wq"), (d, hq), True),
            Entry(p + "self_attn.k_proj.weight", ("layers", j, "wk"), (d, hkv), True),
            Entry(p + "self_attn.v_proj.weight", ("layers", j, "wv"), (d, hkv), True),
            Entry(p + "self_attn.o_proj.weight", ("layers", j, "wo"), (hq, d), True),
            Entry(p + "post_attention_layernorm.weight", ("layers", j, "mlp_norm", "scale"), (d,)),
            Entry(p + "mlp.gate_proj.weight", ("layers", j, "w_gate"), (d, f), True),
            Entry(p + "mlp.up_proj.weight", ("layers", j, "w_up"), (d, f), True),
            Entry(p + "mlp.down_proj.weight", ("layers", j, "w_down"), (f, d), True),
        ]
        if cfg.qkv_bias:
            out += [Entry(p + "self_attn.q_proj.bias", ("layers", j, "bq"), (hq,)),
                    Entry(p + "self_attn.k_proj.bias", ("layers", j, "bk"), (hkv,)),
                    Entry(p + "self_attn.v_proj.bias", ("layers", j, "bv"), (hkv,))]
    if is_last:
        out.append(Entry("model.norm.weight", ("final_norm", "scale"), (d,)))
        if not cfg.tie_embeddings:
            out.append(Entry("lm_head.weight", ("lm_head",), (d, v), True))
    return out


def llm_load_plan(paths_or_dir, cfg: LLMConfig, start: int = 0, end: int | None = None
                  ) -> LoadPlan:
    """What loading layers [start, end) reads (a tied checkpoint may carry lm_head.weight)."""
    ckpt = Checkpoint(paths_or_dir)
    known = {e.hf for e in llm_entries(cfg)}
    if cfg.tie_embeddings and "lm_head.weight" in ckpt.file:
        known.add("lm_head.weight")
    return LoadPlan(ckpt, llm_entries(cfg, start, end), known, "LLM")


def check_tied_head(ckpt: Checkpoint, cfg: LLMConfig, embed=None) -> None:
    """A tied checkpoint's `lm_head.weight`, if any, must equal the embedding."""
    if not (cfg.tie_embeddings and "lm_head.weight" in ckpt.file):
        return
    embed = ckpt.read("model.embed_tokens.weight") if embed is None else embed
    if not np.array_equal(np.asarray(ckpt.read("lm_head.weight"), np.float32),
                          np.asarray(embed, np.float32)):
        raise ValueError("LLM: cfg.tie_embeddings is True but the checkpoint's "
                         "'lm_head.weight' differs from 'model.embed_tokens.weight'; "
                         "set tie_embeddings=False (config.json tie_word_embeddings)")


def load_llm_safetensors(paths_or_dir, cfg: LLMConfig, start: int = 0, end: int | None = None,
                         dtype=np.float32) -> dict:
    """HF Llama/Qwen2 safetensors -> pure dict for `LLM(cfg, key, start, end)`.

    Reads only layers [start, end) (renumbered from 0) plus the embedding / final norm /
    head the stage holds. A tied checkpoint may still carry `lm_head.weight`; it is accepted
    only if it equals the embedding.
    """
    plan = llm_load_plan(paths_or_dir, cfg, start, end)
    pure = plan.read(dtype)
    if "embed" in pure:
        check_tied_head(plan.ckpt, cfg, pure["embed"])
    return pure


def export_llm_safetensors(module_or_pure_dict, cfg: LLMConfig, path, start: int = 0,
                           max_shard_bytes: int | None = None, dtype=None,
                           source=None) -> list[Path]:
    """Inverse of `load_llm_safetensors`: an `LLM` module (or its pure dict, holding layers
    [start, start + n)) -> HF-named safetensors. Writing to a directory also writes
    config.json, so the directory is a loadable HF checkpoint. Returns the files written.
    `source`: the checkpoint a whole LLM was imported from, written again with this LLM's
    tensors in place (unchanged ones copied byte for byte, in their dtype; write_back.py)."""
    start = getattr(module_or_pure_dict, "start", start)
    pure = module_pure(module_or_pure_dict)
    n = len(pure.get("layers", {}))
    if source is not None:
        from mmjax.models.hf.write_back import write_over_source

        entries = llm_entries(cfg, start, start + n)
        plan = llm_load_plan(source, cfg)
        plan.check()
        ours = {}
        for e in entries:
            node = pure
            for k in e.path:
                node = node[k]
            ours[e.hf] = np.ascontiguousarray(e.to_hf(np.asarray(node)))
        return write_over_source(ours, source, path, "LLM", max_shard_bytes)
    files = save_entries(pure, llm_entries(cfg, start, start + n), path, "LLM",
                         max_shard_bytes, dtype)
    if Path(path).suffix != ".safetensors":
        (Path(path) / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return files


def _refuse(field: str, value, why: str):
    raise ValueError(f"config.json {field}={value!r}: {why}")


def rope_from_hf(c: dict) -> tuple[float, tuple | None]:
    """(rope_theta, llama3 scaling or None) from either config layout."""
    params = c.get("rope_parameters") or {}
    legacy = c.get("rope_scaling") or {}
    if any(isinstance(v, dict) for v in params.values()):
        _refuse("rope_parameters", params, "per-layer-type RoPE is not modelled by mmjax's decoder")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    if "rope_theta" in params and "rope_theta" in c and float(c["rope_theta"]) != float(theta):
        _refuse("rope_theta", c["rope_theta"], f"differs from rope_parameters.rope_theta={theta}; "
                "keep one")
    scaling = params if params.get("rope_type", "default") != "default" else legacy
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse("partial_rotary_factor", partial, "mmjax's decoder rotates the whole head")
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        _refuse("rope_type", rope_type, "mmjax models RoPE types 'default' and 'llama3' only")
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        _refuse("rope_type", rope_type, f"llama3 scaling needs {missing}")
    f, lo, hi, orig = (scaling[k] for k in _LLAMA3_KEYS)
    return float(theta), (float(f), float(lo), float(hi), int(orig))


def _check_decoder(c: dict, kind: str) -> None:
    if kind not in LLM_TYPES:
        _refuse("model_type", kind, f"supported LLMs: {', '.join(LLM_TYPES)}")
    if c.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", c["hidden_act"], "mmjax's decoder uses 'silu'")
    for field in ("attention_bias", "mlp_bias"):
        if c.get(field):
            _refuse(field, c[field], "mmjax's decoder has biases only on q/k/v, for qwen2")
    if kind == "qwen2" and c.get("use_sliding_window"):
        _refuse("use_sliding_window", True, "mmjax's decoder attends to every earlier token")
    window = c.get("sliding_window")
    if kind == "mistral" and window is not None and window < c.get("max_position_embeddings", 0):
        _refuse("sliding_window", window, "mmjax's decoder attends to every earlier token "
                "(use a checkpoint with sliding_window null, e.g. Mistral v0.2+)")


def config_from_hf(config) -> LLMConfig:
    """HF Llama / Mistral / Qwen2 config.json (path, checkpoint directory or dict) ->
    LLMConfig. Features mmjax's decoder lacks raise ValueError naming the field instead of
    loading a model that would silently compute something else."""
    c = read_config(config)
    kind = c.get("model_type")
    _check_decoder(c, kind)
    theta, llama3 = rope_from_hf(c)
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim")
    return LLMConfig(
        vocab_size=c["vocab_size"], hidden_size=d, num_layers=c["num_hidden_layers"],
        num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        ffn_size=c["intermediate_size"],
        head_dim=None if head_dim in (None, d // heads) else head_dim,
        rope_theta=theta, rope_llama3=llama3,
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=kind == "qwen2", norm_eps=float(c.get("rms_norm_eps", 1e-6)))


def config_to_hf(cfg: LLMConfig) -> dict:
    """LLMConfig -> HF config.json dict (qwen2 when the model has q/k/v biases, else llama),
    transformers 4 layout (transformers 5 reads it too)."""
    out = {
        "architectures": ["Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if cfg.qkv_bias else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.ffn_size,
        "head_dim": cfg.dim_per_head, "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
    }
    if cfg.rope_llama3 is not None:
        out["rope_scaling"] = dict(zip(_LLAMA3_KEYS, cfg.rope_llama3), rope_type="llama3")
    return out
