"""Whole Qwen2-VL / Qwen2.5-VL checkpoints (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`) <-> an mmjax `MultimodalModel`.

The model: encoder "vision" = `VisionConfig(kind="qwen2_vl")` (`models/qwen2_vl_vision.py`;
the merger's ln_q is the tower's `final_ln`), projector `patch_merger` (the merger's MLP),
LLM = the Qwen2 decoder with `mrope_section` (M-RoPE).

Layouts read (and written back as read): tensor names either legacy (`visual.*`, `model.*`,
`lm_head.weight`: transformers 4, and what transformers 5's `save_pretrained` writes) or
transformers 5's module names (`model.visual.*`, `model.language_model.*`, `lm_head.weight`);
config.json flat (transformers 4: text fields, `rope_theta` and `rope_scaling: {type: mrope,
mrope_section}` at the top level) or nested (transformers 5: `text_config` with
`rope_parameters`). `save` with no source writes what transformers 5's save_pretrained
writes: legacy names, nested config.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.config import (EncoderSpec, MLLMConfig, ProjectorConfig,
                                 VisionConfig)
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, apply_to_module, dense,
                                        hf_tensors, module_pure, read_config, save_entries)
from mmjax.models.hf.llm import check_tied_head, config_from_hf, llm_entries
from mmjax.models.hf.cast import set_config_dtype
from mmjax.models.hf.qwen2_vl_layouts import convert_config, renamer
from mmjax.models.mllm import MultimodalModel

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
ARCHITECTURES = {"Qwen2VLForConditionalGeneration": "qwen2_vl",
                 "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
_CLASS = {v: k for k, v in ARCHITECTURES.items()}
_ACTS = {"quick_gelu": "quick_gelu", "silu": "silu", "gelu": "gelu",
         "gelu_pytorch_tanh": "gelu_tanh"}
_TOKENS = {"image_token_id": 151655, "video_token_id": 151656,
           "vision_start_token_id": 151652, "vision_end_token_id": 151653}
_VISION_DEFAULTS = {
    "qwen2_vl": dict(depth=32, embed_dim=1280, hidden_size=3584, hidden_act="quick_gelu",
                     mlp_ratio=4, num_heads=16, in_channels=3, patch_size=14,
                     spatial_merge_size=2, temporal_patch_size=2),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420,
                       num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31]),
}
NAMES = ("legacy", "modules")  # tensor-name layouts
CONFIG_FORMATS = ("flat", "nested")  # config.json layouts


class Conv3dEntry(Entry):
    """HF's Conv3d patch embedding [out, C, T, p, p] <-> our kernel [C*T*p*p, out]
    (flattened in HF's (c, t, py, px) order, which is the pixel_values feature order)."""

    @property
    def hf_shape(self):
        t = self.shape[0] // (self.patch * self.patch * 3)
        return (self.shape[1], 3, t, self.patch, self.patch)

    def to_ours(self, arr):
        return arr.reshape(arr.shape[0], -1).T

    def to_hf(self, arr):
        return arr.T.reshape(self.hf_shape)


def _refuse(field: str, value, why: str) -> NoReturn:
    raise ValueError(f"config.json {field}={value!r}: {why}")


def model_type_of(c: dict) -> str | None:
    kind = c.get("model_type") or next(
        (ARCHITECTURES[a] for a in c.get("architectures", []) if a in ARCHITECTURES), None)
    return kind if kind in QWEN_VL_TYPES else None


def _text_dict(c: dict) -> tuple[dict, tuple[int, ...]]:
    """The Qwen2 decoder's fields as `hf.llm.config_from_hf` reads them, and mrope_section."""
    nested = "text_config" in c
    text = dict(c["text_config"]) if nested else dict(c)
    params = text.get("rope_parameters") or {}
    legacy = text.get("rope_scaling") or {}
    rope = params or legacy
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        _refuse("rope_parameters.rope_type" if params else "rope_scaling.type", rope_type,
                "mmjax's Qwen2-VL decoder models M-RoPE with the default frequencies only")
    if text.get("use_sliding_window"):
        _refuse("text_config.use_sliding_window" if nested else "use_sliding_window", True,
                "mmjax's Qwen2-VL decoder attends over the whole sequence (no window)")
    section = rope.get("mrope_section", [16, 24, 24])
    theta = params.get("rope_theta", text.get("rope_theta", 1000000.0))
    tie = bool(c.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    keep = {k: v for k, v in text.items() if k not in ("rope_parameters", "rope_scaling",
                                                        "model_type", "architectures")}
    keep.update(model_type="qwen2", rope_theta=theta, tie_word_embeddings=tie)
    return keep, tuple(int(s) for s in section)


def vision_from_hf(kind: str, vision: dict) -> tuple[VisionConfig, int]:
    """-> (tower config, merger output width)."""
    v = dict(_VISION_DEFAULTS[kind], **vision)
    if isinstance(v["patch_size"], (list, tuple)) or isinstance(v["temporal_patch_size"],
                                                                 (list, tuple)):
        _refuse("vision_config.patch_size", v["patch_size"], "mmjax takes square patches "
                "and one temporal_patch_size (ints)")
    if v["hidden_act"] not in _ACTS:
        _refuse("vision_config.hidden_act", v["hidden_act"], f"mmjax has {sorted(_ACTS)}")
    if v.get("in_channels", 3) != 3:
        _refuse("vision_config.in_channels", v["in_channels"], "mmjax's tower takes RGB (3)")
    theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    common = dict(num_layers=v["depth"], num_heads=v["num_heads"], patch_size=v["patch_size"],
                  num_channels=3, max_grid=1024, norm_eps=1e-6, kind="qwen2_vl",
                  post_norm=False, patch_bias=False, act=_ACTS[v["hidden_act"]],
                  temporal_patch_size=v["temporal_patch_size"],
                  spatial_merge_size=v["spatial_merge_size"], rope_theta=theta)
    if kind == "qwen2_vl":
        d = v["embed_dim"]
        cfg = VisionConfig(hidden_size=d, ffn_size=int(d * v["mlp_ratio"]), norm="layer",
                           **common)
        return cfg, v["hidden_size"]
    cfg = VisionConfig(hidden_size=v["hidden_size"], ffn_size=v["intermediate_size"],
                       norm="rms", gated_mlp=True, window_size=v["window_size"],
                       fullatt_block_indexes=tuple(v["fullatt_block_indexes"]), **common)
    return cfg, v["out_hidden_size"]


def qwen2_vl_config_from_hf(config) -> MLLMConfig:
    """config.json (either layout) of a Qwen2-VL / Qwen2.5-VL checkpoint -> MLLMConfig.
    What mmjax does not model is refused with one line naming the field."""
    c = read_config(config)
    kind = model_type_of(c)
    if kind is None:
        _refuse("model_type", c.get("model_type"), f"not one of {QWEN_VL_TYPES}")
    text, section = _text_dict(c)
    llm = dataclasses.replace(config_from_hf(text), mrope_section=section)
    vision, out = vision_from_hf(kind, c.get("vision_config") or {})
    if out != llm.hidden_size:
        _refuse("vision_config." + ("hidden_size" if kind == "qwen2_vl" else "out_hidden_size"),
                out, f"the merger must output the LLM width text_config.hidden_size="
                     f"{llm.hidden_size}")
    m = vision.spatial_merge_size
    proj = ProjectorConfig(kind="patch_merger", num_layers=2, downsample=m * m)
    return MLLMConfig(name=kind, llm=llm, encoders=(EncoderSpec("vision", vision, proj),),
                      placement="embed", **hf_semantics(c))


def hf_semantics(config) -> dict:
    """MLLMConfig fields that make training see what transformers' Qwen2-VL sees: image
    tokens under the LLM's causal mask, each image wrapped in the checkpoint's own
    vision_start / vision_end tokens (text to M-RoPE), not mmjax's markers."""
    c = read_config(config)
    return {"image_attention": "causal", "modality_markers": True,
            "image_markers": (int(c.get("vision_start_token_id",
                                        _TOKENS["vision_start_token_id"])),
                              int(c.get("vision_end_token_id", _TOKENS["vision_end_token_id"])))}


def _tower_entries(cfg: VisionConfig, p: str) -> list[Entry]:
    d, f = cfg.hidden_size, cfg.ffn_size
    enc = ("encoders", "vision")

    def norm(hf, path):
        out = [Entry(hf + ".weight", enc + path + ("scale",), (d,))]
        return out + ([Entry(hf + ".bias", enc + path + ("bias",), (d,))]
                      if cfg.norm == "layer" else [])

    out: list[Entry] = [Conv3dEntry(p + "patch_embed.proj.weight",
                                    enc + ("patch_embed", "kernel"), (cfg.patch_dim, d),
                                    patch=cfg.patch_size)]
    for i in range(cfg.num_layers):
        b, j = f"{p}blocks.{i}.", ("layers", i)
        out += norm(b + "norm1", j + ("norm1",)) + norm(b + "norm2", j + ("norm2",))
        out += dense(b + "attn.qkv", enc + j + ("qkv",), d, 3 * d)
        out += dense(b + "attn.proj", enc + j + ("proj",), d, d)
        if cfg.gated_mlp:
            out += (dense(b + "mlp.gate_proj", enc + j + ("gate",), d, f)
                    + dense(b + "mlp.up_proj", enc + j + ("up",), d, f)
                    + dense(b + "mlp.down_proj", enc + j + ("down",), f, d))
        else:
            out += (dense(b + "mlp.fc1", enc + j + ("fc1",), d, f)
                    + dense(b + "mlp.fc2", enc + j + ("fc2",), f, d))
    out += norm(p + "merger.ln_q", ("final_ln",))
    return out


def qwen2_vl_entries(cfg: MLLMConfig, names: str = "legacy") -> list[Entry]:
    """HF names of every parameter of `MultimodalModel(cfg)` in layout `names`."""
    if names not in NAMES:
        raise ValueError(f"names={names!r}: use one of {NAMES}")
    spec = cfg.encoder("vision")
    vis, d = cfg.vision_tower(), cfg.llm.hidden_size
    p = "visual." if names == "legacy" else "model.visual."
    hidden = spec.projector.hidden_size or vis.hidden_size * spec.projector.downsample
    proj = ("projectors", "vision")
    out = _tower_entries(vis, p)
    out += dense(p + "merger.mlp.0", proj + ("fc1",), hidden, hidden)
    out += dense(p + "merger.mlp.2", proj + ("fc2",), hidden, d)
    for e in llm_entries(cfg.llm):
        hf = e.hf
        if names == "modules" and hf.startswith("model."):
            hf = "model.language_model." + hf[len("model."):]
        out.append(dataclasses.replace(e, hf=hf, path=("llm",) + e.path))
    return out


def _names_of(ckpt: Checkpoint) -> str:
    if any(n.startswith("model.visual.") for n in ckpt.names):
        return "modules"
    if any(n.startswith("visual.") for n in ckpt.names):
        return "legacy"
    raise ValueError("Qwen2-VL: no 'visual.*' or 'model.visual.*' tensors in the checkpoint; "
                     "not a Qwen2VLForConditionalGeneration / Qwen2_5_VL checkpoint")


def load_qwen2_vl(path, dtype="float32"):
    """A local Qwen2-VL / Qwen2.5-VL directory -> (MultimodalModel, MLLMConfig). The model
    remembers its source (`hf_source`: config.json and tensor-name layout) for `save`."""
    c = read_config(path)
    cfg = qwen2_vl_config_from_hf(c)
    ckpt = Checkpoint(path)
    names = _names_of(ckpt)
    entries = qwen2_vl_entries(cfg, names)
    known = {e.hf for e in entries} | ({"lm_head.weight"} if cfg.llm.tie_embeddings else set())
    pure = LoadPlan(ckpt, entries, known, "Qwen2-VL").read(np.float32)
    if cfg.llm.tie_embeddings:
        check_tied_head(ckpt, cfg.llm, pure["llm"]["embed"])
    model = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
    apply_to_module(model, pure)
    if jnp.dtype(dtype) != jnp.float32:
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda a: a.astype(dtype), state))
    model.hf_source = json.dumps({"config": c, "names": names,
                                  "dir": str(Path(path).resolve())})
    return model, cfg


# ------------------------------------------------------------------------------ export


def _text_fields(cfg: MLLMConfig) -> dict:
    llm = cfg.llm
    return {"vocab_size": llm.vocab_size, "hidden_size": llm.hidden_size,
            "intermediate_size": llm.ffn_size, "num_hidden_layers": llm.num_layers,
            "num_attention_heads": llm.num_heads, "num_key_value_heads": llm.num_kv_heads,
            "rms_norm_eps": llm.norm_eps, "hidden_act": "silu", "use_sliding_window": False}


def _vision_fields(kind: str, cfg: MLLMConfig) -> dict:
    v = cfg.vision_tower()
    inv = {b: a for a, b in _ACTS.items()}
    out = {"depth": v.num_layers, "num_heads": v.num_heads, "in_channels": 3,
           "patch_size": v.patch_size, "spatial_merge_size": v.spatial_merge_size,
           "temporal_patch_size": v.temporal_patch_size, "hidden_act": inv[v.act]}
    if kind == "qwen2_vl":
        return out | {"embed_dim": v.hidden_size, "hidden_size": cfg.llm.hidden_size,
                      "mlp_ratio": v.ffn_size // v.hidden_size}
    return out | {"hidden_size": v.hidden_size, "intermediate_size": v.ffn_size,
                  "out_hidden_size": cfg.llm.hidden_size, "window_size": v.window_size,
                  "fullatt_block_indexes": list(v.fullatt_block_indexes)}


def qwen2_vl_config_to_hf(cfg: MLLMConfig, config_format: str = "nested",
                          base: dict | None = None) -> dict:
    """MLLMConfig -> config.json in `config_format`; the modelled fields are written over
    `base` (the source config.json, so unmodelled fields such as token ids survive)."""
    kind = cfg.name if cfg.name in QWEN_VL_TYPES else (
        "qwen2_5_vl" if cfg.vision_tower().window_size else "qwen2_vl")
    v = cfg.vision_tower()
    if kind == "qwen2_vl" and v.ffn_size % v.hidden_size:
        raise ValueError(f"Qwen2-VL export: ffn_size={v.ffn_size} is not mlp_ratio * "
                         f"hidden_size={v.hidden_size} (Qwen2-VL's config has an int mlp_ratio)")
    out: dict[str, Any] = copy.deepcopy(base) if base else dict(_TOKENS)
    out.update(architectures=[_CLASS[kind]], model_type=kind,
               tie_word_embeddings=cfg.llm.tie_embeddings)
    if cfg.image_markers is not None:  # the ids training wrapped images in
        out.update(vision_start_token_id=int(cfg.image_markers[0]),
                   vision_end_token_id=int(cfg.image_markers[1]))
    vision = dict(out.get("vision_config") or {}, **_vision_fields(kind, cfg))
    section = cfg.llm.mrope_section
    if section is None:
        raise ValueError("Qwen2-VL export: llm.mrope_section is None; Qwen2-VL's LLM uses "
                         "M-RoPE (set mrope_section)")
    if config_format == "flat":
        vision.setdefault("model_type", kind)
        scaling = dict(out.get("rope_scaling") or {"type": "mrope"})
        scaling["mrope_section"] = list(section)
        out.update(_text_fields(cfg), rope_theta=cfg.llm.rope_theta, rope_scaling=scaling,
                   vision_config=vision)
        return out
    if config_format != "nested":
        raise ValueError(f"config_format={config_format!r}: use one of {CONFIG_FORMATS}")
    vision.setdefault("model_type", kind + "_vision")
    text = dict(out.get("text_config") or {"model_type": kind + "_text"}, **_text_fields(cfg))
    if cfg.llm.tie_embeddings or "tie_word_embeddings" in text:  # where transformers puts it
        text["tie_word_embeddings"] = cfg.llm.tie_embeddings
    rope = dict(text.get("rope_parameters") or {"rope_type": "default"})
    rope.update(rope_theta=cfg.llm.rope_theta, mrope_section=list(section))
    text["rope_parameters"] = rope
    out.update(text_config=text, vision_config=vision)
    return out


def save_qwen2_vl(model, cfg: MLLMConfig, out_dir, names: str | None = None,
                  config_format: str | None = None, max_shard_bytes: int | None = None,
                  source=None, dtype=None):
    """Write `model` (a module or its pure dict) as a Qwen2-VL / Qwen2.5-VL checkpoint
    directory. `source`: the checkpoint directory it came from (default: the one `load` read,
    `hf_source`); it is written again with the model's tensors in place (write_back.py):
    every tensor in the source's dtype, unchanged ones byte for byte, the source's
    config.json fields, processor and tokenizer files kept. Layout defaults: the source's
    tensor names and config.json layout (transformers 4 flat, 5 nested), else transformers
    5's save_pretrained layout (legacy names, nested config). `dtype`: every tensor in it.
    Returns the files written."""
    from mmjax.models.hf.write_back import write_over_source

    remembered = json.loads(getattr(model, "hf_source", "null") or "null")
    if source is None and remembered and remembered.get("dir"):
        source = remembered["dir"] if Path(remembered["dir"]).is_dir() else None
    base = read_config(source) if source is not None else (
        remembered["config"] if remembered else None)
    src_names = _names_of(Checkpoint(source)) if source is not None else (
        remembered["names"] if remembered else None)
    names = names or src_names or "legacy"
    if names not in NAMES:
        raise ValueError(f"names={names!r}: use one of {NAMES}")
    fmt = config_format or ("nested" if base is None or "text_config" in base else "flat")
    if base is not None and ("text_config" in base) != (fmt == "nested"):
        base = convert_config(base, fmt)
    pure = module_pure(model)
    if source is not None:
        assert src_names is not None  # read from the source checkpoint above
        ours = hf_tensors(pure, qwen2_vl_entries(cfg, src_names), "Qwen2-VL")
        files = write_over_source(ours, source, out_dir, "Qwen2-VL", max_shard_bytes, dtype,
                                  renamer(src_names, names))
    else:
        files = save_entries(pure, qwen2_vl_entries(cfg, names), out_dir, "Qwen2-VL",
                             max_shard_bytes, dtype)
    conf = qwen2_vl_config_to_hf(cfg, fmt, base)
    if dtype is not None:
        set_config_dtype(conf, np.dtype(dtype).name)
    (Path(out_dir) / "config.json").write_text(json.dumps(conf, indent=2))
    return files
