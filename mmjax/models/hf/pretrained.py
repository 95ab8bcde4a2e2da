"""Pretrained parts into a model (Cornstarch §3): the LLM and any encoder from HF
checkpoints (projectors and the generator keep their init), or the whole model from one
LlavaForConditionalGeneration checkpoint (`pretrained.model = DIR`: tower, projector and LLM,
with HF LLaVA's semantics; hf/llava.py).

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

from mmjax.errors import UserError
from mmjax.models.config import AudioConfig, MLLMConfig, VisionConfig
from mmjax.models.hf.checkpoint import LoadPlan, _flatten, _set, apply_to_module, read_config
from mmjax.models.hf.dispatch import config_for, load_pure, model_type
from mmjax.models.hf.llm import LLM_TYPES, check_tied_head, llm_load_plan
from mmjax.models.hf.qwen2_vl import qwen2_vl_config_from_hf
from mmjax.models.hf.qwen2_vl_pretrained import (is_qwen2_vl_dir, qwen2_vl_check_tied,
                                                 qwen2_vl_projector_plan, qwen2_vl_unit_plan)
from mmjax.models.hf.vision import VISION_TYPES, vit_load_plan
from mmjax.models.hf.whisper import whisper_load_plan
from mmjax.models.units import LLM_UNIT, has_llm, is_encoder, is_generator, is_llm, is_vae


class PretrainedError(UserError):
    """A pretrained checkpoint that cannot start training (raised before any work)."""


def expand_whole_model(dirs: dict) -> dict:
    """`pretrained.model` naming a whole Qwen2-VL / Qwen2.5-VL checkpoint is its LLM and its
    tower (the merger comes with the tower's last stage): {"llm": dir, "vision": dir}, the
    form every loader reads. A whole LLaVA stays {"model": dir} (hf/llava.py reads it);
    anything else is returned as it is (`pretrained_config` judges it)."""
    path = dirs.get("model")
    if path is None or len(dirs) > 1 or not is_qwen2_vl_dir(path):
        return dirs
    return {"llm": path, "vision": path}


def whole_base(dirs: dict) -> str | None:
    """The whole-model checkpoint a run's (expanded) dirs start from: a LLaVA's
    `pretrained.model`, or the Qwen2-VL directory that is both its LLM and its tower; None
    for per-unit checkpoints (a peft adapter of such a base names the whole model)."""
    if "model" in dirs:
        return dirs["model"]
    path = dirs.get("llm")
    return path if path is not None and dirs.get("vision") == path and is_qwen2_vl_dir(
        path) else None


def prepare_pretrained(cfg: MLLMConfig, dirs: dict) -> MLLMConfig:
    """`pretrained_config` + `check_pretrained`, errors as one `PretrainedError`."""
    try:
        cfg = pretrained_config(cfg, dirs)
        check_pretrained(cfg, dirs)
    except (UserError, ValueError, FileNotFoundError) as e:
        raise PretrainedError(f"pretrained: {e}") from e
    return cfg


def load_plan(path, cfg, start: int = 0, end: int | None = None) -> LoadPlan:
    if is_qwen2_vl_dir(path):  # a whole Qwen2-VL checkpoint: its LLM or its tower
        return qwen2_vl_unit_plan(path, cfg, start, end)
    if isinstance(cfg, VisionConfig):
        return vit_load_plan(path, cfg, start, end)
    if isinstance(cfg, AudioConfig):
        return whisper_load_plan(path, cfg, start, end)
    return llm_load_plan(path, cfg, start, end)


def _unit_config(old, path):
    """The unit's config from config.json; a vision tower keeps the config's feature_layer,
    max_images and (if larger) max_grid, an LLM its scan_layers: mmjax choices, not
    checkpoint facts. A whole Qwen2-VL checkpoint gives its LLM or its tower."""
    if is_qwen2_vl_dir(path):
        full = qwen2_vl_config_from_hf(path)
        if not isinstance(old, VisionConfig):
            return dataclasses.replace(full.llm, scan_layers=old.scan_layers)
        new = full.encoder("vision").encoder
        return dataclasses.replace(new, max_grid=max(new.max_grid, old.max_grid))
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


def _model_config(cfg: MLLMConfig, path) -> MLLMConfig:
    """The whole model from a LLaVA config.json; the run keeps its name, frozen flags and
    the tower's max_images / max_grid (mmjax choices)."""
    from mmjax.models.hf.llava import is_llava, llava_config_from_hf

    if not is_llava(path):
        raise ValueError(f"pretrained.model: {path} is not a LlavaForConditionalGeneration "
                         f"checkpoint (config.json model_type={read_config(path).get('model_type')!r}); "
                         f"whole-model checkpoints supported: llava, qwen2_vl, qwen2_5_vl")
    new, _ = llava_config_from_hf(path)
    old = {e.name: e for e in cfg.encoders}
    if "vision" not in old or cfg.generator is not None or len(old) != 1:
        raise ValueError(f"pretrained.model: a LLaVA checkpoint is one 'vision' tower, a "
                         f"projector and an LLM; the gin model has encoders {sorted(old)} and "
                         f"generator={cfg.generator is not None} (use e.g. --model=llava_tiny)")
    spec, was = new.encoder("vision"), old["vision"]
    tower = new.vision_tower()
    if isinstance(was.encoder, VisionConfig) and was.encoder.kind == "vit":
        tower = dataclasses.replace(tower, max_images=was.encoder.max_images,
                                    max_grid=max(tower.max_grid, was.encoder.max_grid))
    spec = dataclasses.replace(spec, encoder=tower, frozen=was.frozen,
                               projector_frozen=was.projector_frozen)
    return new.replace(name=cfg.name, encoders=(spec,), llm_frozen=cfg.llm_frozen)


def pretrained_config(cfg: MLLMConfig, dirs: dict) -> MLLMConfig:
    """`cfg` with each unit named in `dirs` ({"llm": dir, "<encoder>": dir}) replaced by the
    config its checkpoint's config.json describes; {"model": dir}: the whole model."""
    if "model" in dirs:
        if len(dirs) > 1:
            raise ValueError(f"pretrained.model names the whole model: leave "
                             f"{sorted(u for u in dirs if u != 'model')} unset")
        return _model_config(cfg, dirs["model"])
    for unit in dirs:
        if unit not in cfg.unit_names or is_generator(unit):
            raise ValueError(f"pretrained.{unit}: no such unit; pretrained units are 'llm' and "
                             f"the encoders {[e.name for e in cfg.encoders]}")
    if has_llm(dirs):
        cfg = cfg.replace(llm=_unit_config(cfg.llm, dirs["llm"]))
    encoders = tuple(dataclasses.replace(e, encoder=_unit_config(e.encoder, dirs[e.name]))
                     if e.name in dirs else e for e in cfg.encoders)
    # a Qwen2-VL tower brings its merger: the projector is the checkpoint's patch_merger
    encoders = tuple(dataclasses.replace(e, projector=qwen2_vl_config_from_hf(
        dirs[e.name]).encoder("vision").projector)
        if e.name in dirs and is_qwen2_vl_dir(dirs[e.name]) else e for e in encoders)
    cfg = cfg.replace(encoders=encoders)
    if has_llm(dirs) and is_qwen2_vl_dir(dirs[LLM_UNIT]) and any(
            dirs.get(e.name) == dirs[LLM_UNIT] for e in cfg.encoders):
        # a whole Qwen2-VL (pretrained.model): trained as transformers runs it
        from mmjax.models.hf.qwen2_vl import hf_semantics
        cfg = cfg.replace(**hf_semantics(dirs["llm"]))
    return cfg


def unit_config(cfg: MLLMConfig, unit: str):
    return cfg.llm if is_llm(unit) else cfg.encoder(unit).encoder


def check_pretrained(cfg: MLLMConfig, dirs: dict) -> None:
    """Every shard present, every tensor of every unit present with its shape, nothing
    unexpected (headers only; a tied LLM's head is compared with its embedding)."""
    if "model" in dirs:
        from mmjax.models.hf.llava import llava_load_plan
        llava_load_plan(dirs["model"], cfg).check()
        return
    for unit, path in dirs.items():
        plan = load_plan(path, unit_config(cfg, unit))
        plan.check()
        if not is_llm(unit) and is_qwen2_vl_dir(path):
            qwen2_vl_projector_plan(path).check()
        elif is_llm(unit) and is_qwen2_vl_dir(path):
            qwen2_vl_check_tied(path, cfg.llm)
        elif is_llm(unit):
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
        def read(idx, e=e, dtype=leaf.dtype):
            return np.asarray(plan.read_part(e, idx), dtype)
        new = jax.make_array_from_callback(leaf.shape, leaf.sharding, read)
        _set(pure, root + e.path, new)
    nnx.replace_by_pure_dict(state, pure)
    return state


def projector_plan(path, cfg: MLLMConfig, unit: str) -> LoadPlan | None:
    """The pretrained projector of encoder `unit` (a whole Qwen2-VL checkpoint's merger MLP),
    or None: other checkpoints hold no projector (it keeps its init)."""
    if not is_llm(unit) and is_qwen2_vl_dir(path):
        return qwen2_vl_projector_plan(path)
    return None


def stage_load_plan(path, cfg: MLLMConfig, unit: str, start: int, end: int | None,
                    whole_model: bool = False) -> tuple[LoadPlan, tuple]:
    """(what a stage of `unit` with layers [start, end) reads, the root its entries' paths
    hang from in the stage's state). `whole_model`: `path` is a LLaVA checkpoint of the
    whole model; an encoder's last stage then also reads the projector."""
    if not whole_model:
        root = () if is_llm(unit) else ("encoders", unit)
        return load_plan(path, unit_config(cfg, unit), start, end), root
    from mmjax.models.hf.llava import llava_stage_plan
    return llava_stage_plan(path, cfg, unit, start, end), ()


def load_pretrained_dirs(model, dirs: dict):
    """`load_into_model` for a run's {unit: dir} (or {"model": dir}); the VAE unit's
    diffusers directory (`vae_unit_dir`) into `model.vae`; a peft adapter ("adapter",
    `pretrained.adapter`) into the LoRA adapters, after the base."""
    if "adapter" in dirs:  # a peft adapter: the base first, then its tensors (hf/peft.py)
        from mmjax.models.hf.peft import model_adapter, put_arrays
        dirs = dict(dirs)
        adapter = dirs.pop("adapter")
        load_pretrained_dirs(model, dirs)
        put_arrays(model, model_adapter(model.cfg, adapter, whole_base(dirs) is not None)[1])
        return model
    vae_dir = vae_unit_dir(dirs)
    if vae_dir is not None:
        from mmjax.models.hf.vae import load_vae_safetensors
        nnx.update(model.vae, nnx.state(load_vae_safetensors(vae_dir, model.cfg.vae)[0]))
    if "model" in dirs:
        from mmjax.models.hf.llava import llava_load_plan
        apply_to_module(model, llava_load_plan(dirs["model"], model.cfg).read())
        return model
    encoders = {k: v for k, v in dirs.items() if is_encoder(k)}
    return load_into_model(model, dirs.get("llm"), encoders)


def vae_unit_dir(dirs: dict) -> str | None:
    """The diffusers AutoencoderKL directory of the model's VAE unit in a run's pretrained
    {unit: dir} (set when the VAE is placed on devices), or None."""
    return next((d for u, d in dirs.items() if is_vae(u)), None)


def load_into_model(model, llm_path=None, encoder_paths: dict | None = None):
    """`llm_path`: an HF Llama / Mistral / Qwen2 checkpoint (or a whole Qwen2-VL one) for
    `model.llm`; `encoder_paths` {encoder name: HF CLIP / SigLIP (vision, kind="vit"),
    Whisper or whole Qwen2-VL checkpoint (tower and merger)}."""
    if llm_path is not None:
        llm = model.llm
        apply_to_module(llm, load_plan(llm_path, model.cfg.llm, llm.start, llm.end).read()
                        if is_qwen2_vl_dir(llm_path)
                        else load_pure(llm_path, model.cfg.llm, llm.start, llm.end))
    for name, path in (encoder_paths or {}).items():
        enc_cfg = model.cfg.encoder(name).encoder
        if is_qwen2_vl_dir(path):
            enc = model.encoders[name]
            apply_to_module(enc, load_plan(path, enc_cfg, enc.start, enc.end).read())
            apply_to_module(model.projectors[name], qwen2_vl_projector_plan(path).read())
            continue
        if getattr(enc_cfg, "kind", "vit") != "vit":
            raise ValueError(f"encoder {name!r}: HF ViT checkpoints (1-D position table) have "
                             f"no faithful mapping onto the packed ViT (factorised 2-D "
                             f"positions); use VisionConfig(kind='vit') (hf.vision_config_from_hf)")
        enc = model.encoders[name]
        apply_to_module(enc, load_pure(path, enc_cfg, enc.start, enc.end))
    return model
