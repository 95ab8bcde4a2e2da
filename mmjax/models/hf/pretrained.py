"""Pretrained parts into a model (Cornstarch §3): the LLM and any encoder from HF
checkpoints; projectors and the generator keep their init.

`pretrained_config` builds the units' configs from the checkpoints' config.json (no
hand-copied sizes); `check_pretrained` checks every file, tensor name and shape from the
headers before any work; `load_stage_state` fills a pipeline stage's placed (sharded)
state straight from the files: each device's block of each tensor is read with safetensors
`get_slice`, so a stage reads only its own layers, a TP rank only its slices, and a
process only the blocks of its own devices.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from mmjax.models.config import AudioConfig, MLLMConfig, VisionConfig
from mmjax.models.hf.checkpoint import LoadPlan, _flatten, _set, apply_to_module, read_config
from mmjax.models.hf.dispatch import config_for, load_pure, model_type
from mmjax.models.hf.llm import LLM_TYPES, check_tied_head, llm_load_plan
from mmjax.models.hf.vision import VISION_TYPES, vit_load_plan
from mmjax.models.hf.whisper import whisper_load_plan


class PretrainedError(ValueError):
    """A pretrained checkpoint that cannot start training (raised before any work)."""


def prepare_pretrained(cfg: MLLMConfig, dirs: dict) -> MLLMConfig:
    """`pretrained_config` + `check_pretrained`, errors as one `PretrainedError`."""
    try:
        cfg = pretrained_config(cfg, dirs)
        check_pretrained(cfg, dirs)
    except (ValueError, FileNotFoundError) as e:
        raise PretrainedError(f"pretrained: {e}") from e
    return cfg


def load_plan(path, cfg, start: int = 0, end: int | None = None) -> LoadPlan:
    if isinstance(cfg, VisionConfig):
        return vit_load_plan(path, cfg, start, end)
    if isinstance(cfg, AudioConfig):
        return whisper_load_plan(path, cfg, start, end)
    return llm_load_plan(path, cfg, start, end)


def _unit_config(old, path):
    """The unit's config from config.json; a vision tower keeps the config's feature_layer,
    max_images and (if larger) max_grid, an LLM its scan_layers: mmjax choices, not
    checkpoint facts."""
    kind = model_type(read_config(path))
    if isinstance(old, VisionConfig):
        if kind not in VISION_TYPES:
            raise ValueError(f"pretrained vision checkpoint {path}: model_type={kind!r} is not "
                             f"a vision tower ({', '.join(VISION_TYPES)})")
        vit = old.kind == "vit"
        new = config_for(path, feature_layer=old.feature_layer if vit else None,
                         max_images=old.max_images if vit else 1)
        return dataclasses.replace(new, max_grid=max(new.max_grid, old.max_grid))
    if isinstance(old, AudioConfig) and kind != "whisper":
        raise ValueError(f"pretrained audio checkpoint {path}: model_type={kind!r}, expected "
                         f"'whisper'")
    if not isinstance(old, (VisionConfig, AudioConfig)) and kind not in LLM_TYPES:
        raise ValueError(f"pretrained llm checkpoint {path}: model_type={kind!r}, expected "
                         f"one of {', '.join(LLM_TYPES)}")
    new = config_for(path)
    if not isinstance(old, (VisionConfig, AudioConfig)):  # layer scan: an mmjax choice
        new = dataclasses.replace(new, scan_layers=old.scan_layers)
    return new


def pretrained_config(cfg: MLLMConfig, dirs: dict) -> MLLMConfig:
    """`cfg` with each unit named in `dirs` ({"llm": dir, "<encoder>": dir}) replaced by the
    config its checkpoint's config.json describes."""
    for unit in dirs:
        if unit not in cfg.unit_names or unit == "generator":
            raise ValueError(f"pretrained.{unit}: no such unit; pretrained units are 'llm' and "
                             f"the encoders {[e.name for e in cfg.encoders]}")
    if "llm" in dirs:
        cfg = cfg.replace(llm=_unit_config(cfg.llm, dirs["llm"]))
    encoders = tuple(dataclasses.replace(e, encoder=_unit_config(e.encoder, dirs[e.name]))
                     if e.name in dirs else e for e in cfg.encoders)
    return cfg.replace(encoders=encoders)


def unit_config(cfg: MLLMConfig, unit: str):
    return cfg.llm if unit == "llm" else cfg.encoder(unit).encoder


def check_pretrained(cfg: MLLMConfig, dirs: dict) -> None:
    """Every shard present, every tensor of every unit present with its shape, nothing
    unexpected (headers only; a tied LLM's head is compared with its embedding)."""
    for unit, path in dirs.items():
        plan = load_plan(path, unit_config(cfg, unit))
        plan.check()
        if unit == "llm":
            check_tied_head(plan.ckpt, cfg.llm)


def load_stage_state(state: nnx.State, plan: LoadPlan, root: tuple = ()) -> nnx.State:
    """`state` (a stage's placed parameters; leaves that are not arrays of this process are
    left alone) with every entry of `plan` under `root` read from the files block by block
    onto the leaf's own sharding. Entries not in `state` (the other split) are skipped."""
    pure = nnx.to_pure_dict(state)
    flat = _flatten(pure)
    for e in plan.entries:
        leaf = flat.get(root + e.path)
        if not isinstance(leaf, jax.Array):
            continue
        dtype = leaf.dtype
        new = jax.make_array_from_callback(
            leaf.shape, leaf.sharding,
            lambda idx, e=e, dtype=dtype: np.asarray(plan.read_part(e, idx), dtype))
        _set(pure, root + e.path, new)
    nnx.replace_by_pure_dict(state, pure)
    return state


def load_into_model(model, llm_path=None, encoder_paths: dict | None = None):
    """`llm_path`: an HF Llama / Mistral / Qwen2 checkpoint for `model.llm`; `encoder_paths`
    {encoder name: HF CLIP / SigLIP (vision, kind="vit") or Whisper checkpoint}."""
    if llm_path is not None:
        llm = model.llm
        apply_to_module(llm, load_pure(llm_path, model.cfg.llm, llm.start, llm.end))
    for name, path in (encoder_paths or {}).items():
        enc_cfg = model.cfg.encoder(name).encoder
        if getattr(enc_cfg, "kind", "vit") != "vit":
            raise ValueError(f"encoder {name!r}: HF ViT checkpoints (1-D position table) have "
                             f"no faithful mapping onto the packed ViT (factorised 2-D "
                             f"positions); use VisionConfig(kind='vit') (hf.vision_config_from_hf)")
        enc = model.encoders[name]
        apply_to_module(enc, load_pure(path, enc_cfg, enc.start, enc.end))
    return model
