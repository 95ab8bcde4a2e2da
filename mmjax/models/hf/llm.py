"""Hugging Face decoder LLMs <-> `models.llm.LLM`: Llama 2 / 3 / 3.1 / 3.2, Mistral, Qwen2 / 2.5,
Qwen3, Gemma 2, Gemma 3 (text), Phi-3.

RoPE: HF's modelling code uses the rotate-half convention, like `layers.rope` (first half
x1*cos - x2*sin, second half x2*cos + x1*sin), so q/k weights need no permutation. Config
reading (both transformers 4 and 5 layouts, RoPE scaling, sliding windows, refusals) is
`llm_config.py`. Tensor names: Llama's, plus Qwen3 / Gemma 3's `self_attn.{q,k}_norm`, Gemma's
four norms per layer (`input_layernorm`, `post_attention_layernorm` on the attention output,
`pre_feedforward_layernorm`, `post_feedforward_layernorm`), and Phi-3's fused
`self_attn.qkv_proj` (q, k, v rows) and `mlp.gate_up_proj` (gate, up rows), split into
mmjax's separate projections on load and fused again on export.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmjax.models.config import LLMConfig
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, hf_tensors, module_pure,
                                        save_entries)
from mmjax.models.layer_range import layer_range
from mmjax.models.hf.llm_config import (LLM_TYPES, _infer_type, config_from_hf, config_to_hf,
                                        rope_from_hf)

__all__ = ["LLM_TYPES", "config_from_hf", "config_to_hf", "rope_from_hf", "llm_entries",
           "llm_load_plan", "check_tied_head", "load_llm_safetensors", "export_llm_safetensors"]


def _layer_entries(cfg: LLMConfig, i: int, j: int, kind: str) -> list[Entry]:
    """HF entries of global layer i, held as local layer j."""
    d, f, hd = cfg.hidden_size, cfg.ffn_size, cfg.dim_per_head
    hq, hkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    p, L = f"model.layers.{i}.", ("layers", j)
    norm = lambda name, ours, n=d: Entry(p + name + ".weight", L + (ours, "scale"), (n,))
    out = [norm("input_layernorm", "attn_norm")]
    if kind == "phi3":
        qkv, tot = p + "self_attn.qkv_proj.weight", hq + 2 * hkv
        out += [Entry(qkv, L + ("wq",), (d, hq), rows=(0, hq, tot)),
                Entry(qkv, L + ("wk",), (d, hkv), rows=(hq, hq + hkv, tot)),
                Entry(qkv, L + ("wv",), (d, hkv), rows=(hq + hkv, tot, tot))]
    else:
        out += [Entry(p + "self_attn.q_proj.weight", L + ("wq",), (d, hq), True),
                Entry(p + "self_attn.k_proj.weight", L + ("wk",), (d, hkv), True),
                Entry(p + "self_attn.v_proj.weight", L + ("wv",), (d, hkv), True)]
    if cfg.qkv_bias:
        out += [Entry(p + "self_attn.q_proj.bias", L + ("bq",), (hq,)),
                Entry(p + "self_attn.k_proj.bias", L + ("bk",), (hkv,)),
                Entry(p + "self_attn.v_proj.bias", L + ("bv",), (hkv,))]
    if cfg.qk_norm:
        out += [norm("self_attn.q_norm", "q_norm", hd), norm("self_attn.k_norm", "k_norm", hd)]
    out.append(Entry(p + "self_attn.o_proj.weight", L + ("wo",), (hq, d), True))
    if cfg.sandwich_norms:
        out += [norm("post_attention_layernorm", "attn_post_norm"),
                norm("pre_feedforward_layernorm", "mlp_norm"),
                norm("post_feedforward_layernorm", "mlp_post_norm")]
    else:
        out.append(norm("post_attention_layernorm", "mlp_norm"))
    if kind == "phi3":
        gu = p + "mlp.gate_up_proj.weight"
        out += [Entry(gu, L + ("w_gate",), (d, f), rows=(0, f, 2 * f)),
                Entry(gu, L + ("w_up",), (d, f), rows=(f, 2 * f, 2 * f))]
    else:
        out += [Entry(p + "mlp.gate_proj.weight", L + ("w_gate",), (d, f), True),
                Entry(p + "mlp.up_proj.weight", L + ("w_up",), (d, f), True)]
    out.append(Entry(p + "mlp.down_proj.weight", L + ("w_down",), (f, d), True))
    return out


def llm_entries(cfg: LLMConfig, start: int = 0, end: int | None = None) -> list[Entry]:
    """HF names (of the family `cfg` came from) for the parameters of `LLM(cfg, key, start,
    end)`."""
    end = layer_range("LLM layer", cfg.num_layers, start, end)[0]
    d, v = cfg.hidden_size, cfg.vocab_size
    kind = _infer_type(cfg)
    is_first, is_last = start == 0, end == cfg.num_layers
    out = []
    if is_first or (is_last and cfg.tie_embeddings):
        out.append(Entry("model.embed_tokens.weight", ("embed",), (v, d)))
    for i in range(start, end):
        out += _layer_entries(cfg, i, i - start, kind)
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

        plan = llm_load_plan(source, cfg)
        plan.check()
        ours = hf_tensors(pure, llm_entries(cfg, start, start + n), "LLM")
        return write_over_source(ours, source, path, "LLM", max_shard_bytes)
    files = save_entries(pure, llm_entries(cfg, start, start + n), path, "LLM",
                         max_shard_bytes, dtype)
    if Path(path).suffix != ".safetensors":
        (Path(path) / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    return files


