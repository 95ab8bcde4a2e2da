"""Hugging Face CLIP / SigLIP vision towers <-> `models.vit.StandardViT`.

CLIP (`clip_vision_model`, or the `vision_config` of a `clip` checkpoint): class token,
position table over grid^2 + 1 positions, bias-free patch conv, `pre_layrnorm`, quick_gelu;
its last_hidden_state is the last layer's output (`post_layernorm` only feeds the pooler).
SigLIP (`siglip_vision_model` / `siglip`): no class token, patch conv with bias,
gelu_pytorch_tanh, `post_layernorm` on last_hidden_state; its attention-pooling head is not
part of the tower mmjax uses (its tensors are accepted and left alone, as are CLIP's text
tower and projections). transformers 4 writes a tower's tensors under `vision_model.`
(LLaVA's under `vision_tower.vision_model.`), transformers 5 without it (`embeddings.*`,
LLaVA's `vision_tower.embeddings.*`): the prefix is found from the patch embedding's name.

Export: a tower imported from a checkpoint is written back over it (`write_back`): layers
above the one the projector reads, `post_layernorm`, a CLIPModel's text tower are copied
untouched. A tower without a source gets CLIP's `post_layernorm` as HF initialises it (it
only feeds the pooler), so transformers loads every export with no missing keys.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from mmjax.models.config import VisionAct, VisionConfig
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, dense, layer_norm,
                                        module_pure, read_config)
from mmjax.models.layer_range import layer_range

VISION_TYPES = ("clip", "clip_vision_model", "siglip", "siglip_vision_model")
_ACTS: dict[str, VisionAct] = {"quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh",
                               "gelu_new": "gelu_tanh", "gelu": "gelu"}
_DEFAULTS = {  # HF CLIPVisionConfig / SiglipVisionConfig defaults for fields a file may omit
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                 hidden_act="quick_gelu", layer_norm_eps=1e-5),
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                   hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6),
}


def vision_config_from_hf(config, feature_layer: int | None = None,
                          max_images: int = 1) -> VisionConfig:
    """HF CLIP / SigLIP config.json (path, directory or dict) -> VisionConfig (kind="vit").
    `feature_layer`: the hidden state the projector reads (None: last_hidden_state; LLaVA:
    -2); `max_images`: images per packed buffer row (class-token slots)."""
    c = read_config(config)
    kind = c.get("model_type")
    if kind not in VISION_TYPES:
        raise ValueError(f"config.json model_type={kind!r}: supported vision towers: "
                         f"{', '.join(VISION_TYPES)}")
    family = kind.split("_")[0]
    tower = c if kind.endswith("_vision_model") else (c.get("vision_config") or {})
    v = dict(_DEFAULTS[family], **tower)
    if v["hidden_act"] not in _ACTS:
        raise ValueError(f"config.json hidden_act={v['hidden_act']!r}: mmjax's ViT has "
                         f"{sorted(_ACTS)}")
    if v["image_size"] % v["patch_size"]:
        raise ValueError(f"config.json image_size={v['image_size']} is not a multiple of "
                         f"patch_size={v['patch_size']}")
    clip = family == "clip"
    grid = v["image_size"] // v["patch_size"]
    return VisionConfig(
        hidden_size=v["hidden_size"], num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"], ffn_size=v["intermediate_size"],
        patch_size=v["patch_size"], num_channels=v["num_channels"], max_grid=max(64, grid),
        norm_eps=float(v["layer_norm_eps"]), kind="vit", image_size=v["image_size"],
        class_token=clip, pre_norm=clip, post_norm=not clip, patch_bias=not clip,
        act=_ACTS[v["hidden_act"]], feature_layer=feature_layer, max_images=max_images)


def vision_config_to_hf(cfg: VisionConfig) -> dict:
    """VisionConfig (kind="vit") -> HF CLIPVisionConfig / SiglipVisionConfig dict."""
    clip = cfg.class_token
    acts = {"quick_gelu": "quick_gelu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}
    head = {} if clip else {"vision_use_head": False}  # the pooling head is not exported
    return head | {"architectures": ["CLIPVisionModel" if clip else "SiglipVisionModel"],
            "model_type": "clip_vision_model" if clip else "siglip_vision_model",
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_channels": cfg.num_channels, "image_size": cfg.image_size,
            "patch_size": cfg.patch_size, "hidden_act": acts[cfg.act],
            "layer_norm_eps": cfg.norm_eps}


def _check_exportable(cfg: VisionConfig) -> None:
    if cfg.kind != "vit" or cfg.class_token != cfg.pre_norm or cfg.class_token == cfg.post_norm \
            or cfg.class_token == cfg.patch_bias:
        raise ValueError("vision: only CLIP-shaped (class_token, pre_norm, no post_norm, no "
                         "patch bias) or SigLIP-shaped (the opposite) ViTs map onto HF towers")


def vit_entries(cfg: VisionConfig, start: int = 0, end: int | None = None,
                prefix: str = "vision_model.") -> list[Entry]:
    """HF CLIP / SigLIP names for `StandardViT(cfg, key, start, end)`."""
    end = layer_range("vision layer", cfg.depth, start, end)[0]
    d, f, e = cfg.hidden_size, cfg.ffn_size, prefix + "embeddings."
    out = []
    if start == 0:
        out += [Entry(e + "patch_embedding.weight", ("patch_embed", "kernel"),
                      (cfg.patch_dim, d), patch=cfg.patch_size),
                Entry(e + "position_embedding.weight", ("pos_embed",), (cfg.num_positions, d))]
        if cfg.patch_bias:
            out.append(Entry(e + "patch_embedding.bias", ("patch_embed", "bias"), (d,)))
        if cfg.class_token:
            out.append(Entry(e + "class_embedding", ("class_embed",), (d,)))
        if cfg.pre_norm:
            out += layer_norm(prefix + "pre_layrnorm", ("pre_ln",), d)
    for i in range(start, end):
        p, j = f"{prefix}encoder.layers.{i}.", ("layers", i - start)
        out += (layer_norm(p + "layer_norm1", j + ("ln1",), d)
                + dense(p + "self_attn.q_proj", j + ("q",), d, d)
                + dense(p + "self_attn.k_proj", j + ("k",), d, d)
                + dense(p + "self_attn.v_proj", j + ("v",), d, d)
                + dense(p + "self_attn.out_proj", j + ("o",), d, d)
                + layer_norm(p + "layer_norm2", j + ("ln2",), d)
                + dense(p + "mlp.fc1", j + ("fc1",), d, f)
                + dense(p + "mlp.fc2", j + ("fc2",), f, d))
    if end == cfg.depth and cfg.final_norm:
        out += layer_norm(prefix + "post_layernorm", ("final_ln",), d)
    return out


def vision_prefix(ckpt: Checkpoint) -> str:
    """The tower's prefix: what precedes `embeddings.patch_embedding.weight` ("vision_model."
    as transformers 4 writes, "" or "vision_tower." as transformers 5 does)."""
    tail = "embeddings.patch_embedding.weight"
    found = sorted(n[: -len(tail)] for n in ckpt.names if n.endswith(tail)
                   and (n == tail or n[-len(tail) - 1] == "."))
    if len(found) != 1:
        raise ValueError(f"vision: expected one '*{tail}' tensor, found {len(found)} "
                         f"{found[:3]}: not a CLIP / SigLIP vision checkpoint")
    return found[0]


def vit_load_plan(paths_or_dir, cfg: VisionConfig, start: int = 0,
                  end: int | None = None) -> LoadPlan:
    """What loading layers [start, end) reads. Layers past `cfg.depth` and the
    post-LayerNorm (when the projector reads an inner hidden state) are known but not
    read; so is SigLIP's pooling head."""
    ckpt = Checkpoint(paths_or_dir)
    prefix = vision_prefix(ckpt)
    whole = dataclasses.replace(cfg, feature_layer=None)
    known = {e.hf for e in vit_entries(whole, prefix=prefix)}
    known |= {prefix + f"post_layernorm.{w}" for w in ("weight", "bias")}
    known |= {n for n in ckpt.names if n.startswith(prefix + "head.")}
    return LoadPlan(ckpt, vit_entries(cfg, start, end, prefix), known, "vision", prefix)


def load_vit_safetensors(paths_or_dir, cfg: VisionConfig, start: int = 0,
                         end: int | None = None, dtype=np.float32) -> dict:
    """HF CLIP / SigLIP safetensors -> pure dict for `StandardViT(cfg, key, start, end)`."""
    return vit_load_plan(paths_or_dir, cfg, start, end).read(dtype)


def _post_layernorm_init(cfg: VisionConfig, prefix: str) -> dict:
    d = cfg.hidden_size  # HF's _init_weights: LayerNorm weight 1, bias 0
    return {prefix + "post_layernorm.weight": np.ones(d, np.float32),
            prefix + "post_layernorm.bias": np.zeros(d, np.float32)}


def vit_hf_tensors(module_or_pure_dict, cfg: VisionConfig, prefix: str) -> dict:
    """{HF name: array in HF layout} of the layers a `StandardViT` holds."""
    import jax

    pure, out = module_pure(module_or_pure_dict), {}
    for e in vit_entries(cfg, prefix=prefix):
        node = pure
        for k in e.path:
            node = node[k]
        arr = np.asarray(jax.device_get(node))
        if arr.shape != e.shape:
            raise ValueError(f"vision: {'.'.join(map(str, e.path))} has shape {arr.shape}, "
                             f"expected {e.shape}")
        out[e.hf] = np.ascontiguousarray(e.to_hf(arr))
    return out


def export_vit_safetensors(module_or_pure_dict, cfg: VisionConfig, path,
                           max_shard_bytes: int | None = None, source=None) -> list[Path]:
    """A `StandardViT` -> an HF CLIP / SigLIP tower directory (or one .safetensors file).
    `source`: the checkpoint it was imported from, written again with this tower's tensors
    in place (every tensor it does not hold copied). Without one, a tower cut at
    `feature_layer` is written with the layers it holds (config num_hidden_layers = its
    depth: the layers above never existed)."""
    _check_exportable(cfg)
    if source is not None:
        from mmjax.models.hf.write_back import write_over_source

        prefix = vision_prefix(Checkpoint(source))
        vit_load_plan(source, cfg).check()  # the source is this tower's checkpoint
        return write_over_source(vit_hf_tensors(module_or_pure_dict, cfg, prefix), source,
                                 path, "vision", max_shard_bytes)
    whole = dataclasses.replace(cfg, num_layers=cfg.depth, feature_layer=None)
    tensors = vit_hf_tensors(module_or_pure_dict, cfg, "vision_model.")
    if not any(k.endswith("post_layernorm.weight") for k in tensors):
        tensors.update(_post_layernorm_init(cfg, "vision_model."))
    from mmjax.models.hf.checkpoint import write_safetensors

    files = write_safetensors(tensors, path, max_shard_bytes)
    if Path(path).suffix != ".safetensors":
        (Path(path) / "config.json").write_text(json.dumps(vision_config_to_hf(whole), indent=2))
    return files
