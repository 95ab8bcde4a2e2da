"""Whole `LlavaForConditionalGeneration` checkpoints <-> `MultimodalModel` (CLIP / SigLIP
tower, 2-layer MLP projector, Llama / Mistral / Qwen2 LLM).

Tensor layouts in the wild (all read; `save` writes the source's own names, else what
transformers 5's `save_pretrained` writes):
  transformers < 4.52: vision_tower.vision_model.*, multi_modal_projector.*,
                       language_model.model.*, language_model.lm_head.weight
  transformers 4.52+:  model.vision_tower.vision_model.*, model.multi_modal_projector.*,
                       model.language_model.*, lm_head.weight
  transformers 5:      vision_tower.* (no vision_model.), multi_modal_projector.*,
                       language_model.model.*, language_model.lm_head.weight on disk
                       (model.vision_tower.* ... in memory)
The model is built with HF's semantics: the tower read at `vision_feature_layer`, its patch
tokens projected (a CLIP tower under the "default" select strategy, class token dropped; a
SigLIP tower under "full"; the other pairings, which drop a patch or keep the class token,
are refused), the projector's activation as
`projector_hidden_act` names it, image tokens under the LLM's causal mask and no modality
markers (`MLLMConfig.image_attention="causal"`, `modality_markers=False`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NoReturn

import jax
import numpy as np
from flax import nnx

from mmjax.models.config import EncoderSpec, MLLMConfig, ProjectorAct, ProjectorConfig
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, apply_to_module, dense,
                                        hf_tensors, read_config, write_safetensors)
from mmjax.models.hf.llm import LLM_TYPES, config_from_hf, config_to_hf, llm_entries
from mmjax.models.hf.vision import (VISION_TYPES, vision_config_from_hf, vision_config_to_hf,
                                    vit_entries)
from mmjax.models.units import is_llm

_ACTS: dict[str, ProjectorAct] = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                                  "gelu_new": "gelu_tanh"}
# The select strategy under which transformers' LLaVA projects exactly the patch tokens:
# "default" drops the first token (CLIP's class token; a SigLIP tower's first patch), "full"
# keeps every token (CLIP's class token too).
_STRATEGY = {"clip": "default", "clip_vision_model": "default", "siglip": "full",
             "siglip_vision_model": "full"}
_STRATEGY_WHY = {"default": "the class token dropped, every patch kept",
                 "full": "every patch kept; 'default' would drop the first patch"}


def _refuse(field: str, value, supported: str) -> NoReturn:
    raise ValueError(f"config.json {field}={value!r}: mmjax supports {supported}")


def llava_config_from_hf(config) -> tuple[MLLMConfig, dict]:
    """LLaVA config.json -> (MLLMConfig, the HF facts mmjax keeps aside: image_token_index,
    the config dict itself)."""
    c = read_config(config)
    text, vision = dict(c.get("text_config") or {}), dict(c.get("vision_config") or {})
    if text.get("model_type") not in LLM_TYPES:
        _refuse("text_config.model_type", text.get("model_type"), ", ".join(LLM_TYPES))
    if vision.get("model_type") not in VISION_TYPES:
        _refuse("vision_config.model_type", vision.get("model_type"), ", ".join(VISION_TYPES))
    layer = c.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        _refuse("vision_feature_layer", layer, "one layer (an int)")
    strategy = c.get("vision_feature_select_strategy", "default")
    want = _STRATEGY[vision["model_type"]]  # one of VISION_TYPES (checked above)
    if strategy != want:  # mmjax projects exactly the patch tokens
        _refuse("vision_feature_select_strategy", strategy,
                f"{want!r} with a {vision.get('model_type')} tower ({_STRATEGY_WHY[want]})")
    act = c.get("projector_hidden_act", "gelu")
    if act not in _ACTS:
        _refuse("projector_hidden_act", act, f"{sorted(_ACTS)}")
    if not c.get("multimodal_projector_bias", True):
        _refuse("multimodal_projector_bias", False, "a projector with biases (True)")
    if "tie_word_embeddings" in c:
        text.setdefault("tie_word_embeddings", c["tie_word_embeddings"])
    # LLaVA's own lm_head has no final soft-cap (a Gemma 2 text model's is not applied)
    llm = dataclasses.replace(config_from_hf(text), final_softcap=None)
    n = vision.get("num_hidden_layers", 12)
    # hidden_states[k], k in 0..n (0: the embeddings) -> mmjax's negative feature_layer
    # (-1: the last layer's output, before SigLIP's post_layernorm, as HF reads it)
    feature = layer if layer < 0 else layer - (n + 1)
    if not -n <= feature <= -1:
        _refuse("vision_feature_layer", layer, f"a layer's output, -{n}..-1 or 1..{n}")
    tower = vision_config_from_hf(vision, feature_layer=feature)
    proj = ProjectorConfig(kind="mlp", num_layers=2, hidden_size=llm.hidden_size, act=_ACTS[act])
    cfg = MLLMConfig(name="llava", llm=llm, encoders=(EncoderSpec("vision", tower, proj),),
                     image_attention="causal", modality_markers=False)
    token = c.get("image_token_index", c.get("image_token_id"))
    if token is None:
        _refuse("image_token_index", None, "a LLaVA config naming its image token")
    return cfg, {"image_token_index": int(token), "config": c}


def _layout(ckpt: Checkpoint) -> dict:
    """The prefixes of a LLaVA checkpoint's parts, from its tensor names."""
    def one(tail: str, what: str) -> str:
        found = sorted(n[: -len(tail)] for n in ckpt.names if n.endswith(tail))
        if len(found) != 1:
            raise ValueError(f"llava: expected one '*{tail}' tensor ({what}), found "
                             f"{len(found)}: not a LlavaForConditionalGeneration checkpoint")
        return found[0]
    tower = one("embeddings.patch_embedding.weight", "the vision tower")
    projector = one("linear_1.weight", "the projector")
    llm = one("embed_tokens.weight", "the language model")
    heads = [n for n in ckpt.names if n.endswith("lm_head.weight")]
    return {"tower": tower, "projector": projector, "llm": llm,
            "head": heads[0] if heads else None}


def _rename_llm(entries, layout: dict) -> list[Entry]:
    out = []
    for e in entries:
        if e.hf == "lm_head.weight":
            out.append(dataclasses.replace(e, hf=layout["head"] or "lm_head.weight"))
        else:
            out.append(dataclasses.replace(e, hf=layout["llm"] + e.hf[len("model."):]))
    return out


def llava_entries(cfg: MLLMConfig, layout: dict) -> list[Entry]:
    """HF names of every parameter of a LLaVA `MultimodalModel` under `layout`."""
    vision = cfg.vision_tower()
    d_v, d = vision.hidden_size, cfg.llm.hidden_size
    p = layout["projector"]
    tower = [dataclasses.replace(e, path=("encoders", "vision") + e.path)
             for e in vit_entries(vision, prefix=layout["tower"])]
    proj = [dataclasses.replace(e, path=("projectors", "vision") + e.path)
            for e in dense(p + "linear_1", ("fc1",), d_v, d) + dense(p + "linear_2", ("fc2",), d, d)]
    llm = [dataclasses.replace(e, path=("llm",) + e.path)
           for e in _rename_llm(llm_entries(cfg.llm), layout)]
    return tower + proj + llm


def llava_load_plan(path, cfg: MLLMConfig) -> LoadPlan:
    ckpt = Checkpoint(path)
    layout = _layout(ckpt)
    whole = dataclasses.replace(cfg.vision_tower(), feature_layer=None)
    full = llava_entries(cfg.replace(encoders=(dataclasses.replace(
        cfg.encoder("vision"), encoder=whole),)), layout)
    known = {e.hf for e in full} | {layout["tower"] + "post_layernorm." + w
                                    for w in ("weight", "bias")}
    known |= {n for n in ckpt.names if n.startswith(layout["tower"] + "head.")}
    if cfg.llm.tie_embeddings and layout["head"]:
        known.add(layout["head"])
    return LoadPlan(ckpt, llava_entries(cfg, layout), known, "llava")


def llava_stage_plan(path, cfg: MLLMConfig, unit: str, start: int = 0,
                     end: int | None = None) -> LoadPlan:
    """A pipeline stage's share of a LLaVA checkpoint: the LLM's layers [start, end) (paths
    within the LLM), or the tower's (paths from the encoder stage's root, the projector on
    its last stage)."""
    plan = llava_load_plan(path, cfg)
    layout = _layout(plan.ckpt)
    if is_llm(unit):
        entries = _rename_llm(llm_entries(cfg.llm, start, end), layout)
    else:
        tower = cfg.vision_tower(unit)
        entries = [dataclasses.replace(e, path=("encoders", unit) + e.path)
                   for e in vit_entries(tower, start, end, layout["tower"])]
        if end is None or end == tower.depth:
            entries += [e for e in plan.entries if e.path[0] == "projectors"]
    return LoadPlan(plan.ckpt, entries, plan.known, "llava", plan.prefix)


def is_llava(config) -> bool:
    c = read_config(config)
    return c.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (
        c.get("architectures") or [])


def load_llava(path, dtype=np.float32):
    """A LLaVA directory -> (MultimodalModel, MLLMConfig, HF facts)."""
    from mmjax.models.mllm import MultimodalModel

    cfg, facts = llava_config_from_hf(path)
    plan = llava_load_plan(path, cfg)
    model = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
    apply_to_module(model, plan.read(dtype))
    return model, cfg, facts


# ---------------------------------------------------------------------------- save


def llava_config_to_hf(cfg: MLLMConfig, image_token_index: int) -> dict:
    spec = cfg.encoder("vision")
    tower = cfg.vision_tower()
    layer = tower.feature_layer if tower.feature_layer is not None else -1
    whole = dataclasses.replace(tower, feature_layer=None)
    acts = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
    text = config_to_hf(cfg.llm)
    text.pop("architectures", None)
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "image_token_index": image_token_index,
            "projector_hidden_act": acts[spec.projector.act],
            "multimodal_projector_bias": True, "vision_feature_layer": layer,
            "vision_feature_select_strategy": "default" if tower.class_token else "full",
            "tie_word_embeddings": cfg.llm.tie_embeddings,
            "text_config": text, "vision_config": vision_config_to_hf(whole)}


def check_llava_model(cfg: MLLMConfig) -> None:
    """The MultimodalModels a LLaVA checkpoint can hold (one line naming the field)."""
    if [e.name for e in cfg.encoders] != ["vision"] or cfg.generator is not None:
        raise ValueError(f"llava: MLLMConfig.encoders={[e.name for e in cfg.encoders]}, "
                         f"generator={cfg.generator is not None}: a LLaVA checkpoint holds one "
                         f"'vision' tower, no generator")
    spec = cfg.encoder("vision")
    if getattr(spec.encoder, "kind", None) != "vit":
        raise ValueError("llava: encoders.vision.encoder.kind must be 'vit' (a CLIP / SigLIP "
                         "tower)")
    pr = spec.projector
    if pr.kind != "mlp" or pr.num_layers != 2 or pr.downsample != 1 or \
            (pr.hidden_size or cfg.llm.hidden_size) != cfg.llm.hidden_size:
        raise ValueError("llava: encoders.vision.projector must be kind='mlp', num_layers=2, "
                         "downsample=1, hidden_size = the LLM's (LLaVA's projector)")


def save_llava(model, cfg: MLLMConfig, out, source=None, image_token_index: int | None = None,
               max_shard_bytes: int | None = None, layout: str | None = None) -> list[Path]:
    """A LLaVA `MultimodalModel` -> a LlavaForConditionalGeneration directory. `source`: the
    checkpoint it was loaded from (its names, its layers above the feature layer and its
    config.json kept; write_back.py); else transformers 5's names and a config.json built
    from `cfg` (`image_token_index` required). `layout` ("tf4", "tf5"): tensor names and
    config.json as that transformers writes them instead (llava_layouts.py)."""
    from mmjax.models.hf.checkpoint import _flatten, module_pure
    from mmjax.models.hf.llava_layouts import (LAYOUTS, _PREFIX, convert_llava_config,
                                               names_layout, renamer)
    check_llava_model(cfg)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"llava: layout={layout!r}: use one of {', '.join(LAYOUTS)}")
    pure = _flatten(module_pure(model))
    if source is not None:
        from mmjax.models.hf.write_back import write_over_source
        plan = llava_load_plan(source, cfg)
        plan.check()
        ours = hf_tensors(pure, plan.entries, "llava")
        rename = layout and renamer(names_layout(Checkpoint(source).names), layout)
        files = write_over_source(ours, source, out, "llava", max_shard_bytes, rename=rename)
        if layout is not None:
            conf = convert_llava_config(read_config(source), layout)
            (Path(out) / "config.json").write_text(json.dumps(conf, indent=2))
        return files
    if image_token_index is None:
        raise ValueError("llava: save without a source needs image_token_index (the "
                         "tokenizer's <image> id)")
    tower = cfg.vision_tower()
    if tower.depth < tower.num_layers:
        raise ValueError(f"llava: encoders.vision.encoder.feature_layer={tower.feature_layer} "
                         f"holds {tower.depth} of {tower.num_layers} layers and no source "
                         f"checkpoint to copy the rest from: pass source=")
    names = _PREFIX[layout or "tf5"]
    tensors = hf_tensors(pure, llava_entries(cfg, names), "llava")
    if not tower.final_norm:  # CLIP's post_layernorm feeds only the pooler: HF's init
        d = tower.hidden_size
        tensors[names["tower"] + "post_layernorm.weight"] = np.ones(d, np.float32)
        tensors[names["tower"] + "post_layernorm.bias"] = np.zeros(d, np.float32)
    files = write_safetensors(tensors, out, max_shard_bytes)
    conf = llava_config_to_hf(cfg, image_token_index)
    (Path(out) / "config.json").write_text(json.dumps(
        convert_llava_config(conf, layout) if layout else conf, indent=2))
    return files
