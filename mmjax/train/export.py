"""A training checkpoint -> Hugging Face checkpoints (scripts/export_hf.py).

The workdir's run.json names the model config, seed and pretrained files (with their sizes and
hashes). Every run is restored the same way, on any host: the checkpoint's trainable arrays
by their plan-independent names (train/logical_state.py), frozen parameters rebuilt as the
run built them (seed init, then the verified pretrained files: bit for bit). Each unit with an
HF counterpart is written, over its source checkpoint when it has one (models/hf/write_back.py):
the LLM (Llama / Mistral / Qwen2), CLIP / SigLIP towers (`VisionConfig(kind="vit")`, also when
read at an inner `feature_layer`), Whisper encoders; a run started from a whole LLaVA is written
whole. Projectors, the generator and packed NaViT-style towers have no HF format: they go to
`mmjax_extra.safetensors` (dotted names) so nothing trained is dropped. A Qwen2-VL-shaped model (tower kind="qwen2_vl") is written
whole, as one Qwen2VL / Qwen2_5_VLForConditionalGeneration checkpoint in out/model.
"""
from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding

from mmjax.errors import UserError
from mmjax.models import hf
from mmjax.models.config import AudioConfig, MLLMConfig
from mmjax.models.config_json import config_from_dict
from mmjax.models.hf.checkpoint import _flatten, save_extra
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.models.units import VAE_UNIT, is_llm, is_vae
from mmjax.models.hf.pretrained import load_pretrained_dirs
from mmjax.parallel.sharded_init import abstract_split, init_split
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.logical_state import single_from_logical, single_logical
from mmjax.train.pretrained_sources import verify as verify_sources
from mmjax.train.run_files import read_run_info
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.state import WHOLE_MODEL, whole_model_state
from mmjax.train.step import split_model

MAX_SHARD_BYTES = 5 * 10 ** 9  # HF's default shard size


def _pure(module) -> dict:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def _pretrained_dirs(info: dict) -> dict:
    """{unit: dir} the run loaded pretrained weights from, checked against the sizes and
    hashes run.json recorded (UserError in one line when gone or changed)."""
    sources = info.get("pretrained_sources")
    if sources:
        return verify_sources(sources)
    dirs = info.get("pretrained") or {}  # a run.json from before the record: existence only
    for unit, d in dirs.items():
        if not os.path.isdir(d):
            raise UserError(f"pretrained.{unit}: {d} is gone: restore the files the run "
                            f"trained with (frozen units are rebuilt from them)")
    return dirs


def restore_model(workdir: str, step: int | None = None
                  ) -> tuple[MLLMConfig, MultimodalModel, int, dict]:
    """-> (model config, the whole `MultimodalModel` as trained at `step` (default newest),
    step, pretrained dirs). Trainable arrays come from the checkpoint; frozen ones are
    rebuilt exactly as the run built them: from the verified pretrained files, else from
    the seed's init. Checkpoints are plan-independent (train/logical_state.py), so a plan
    run restores here on any host, with no device count of the plan's."""
    info = read_run_info(workdir)
    if info is None:
        raise UserError(f"{workdir}/run.json does not exist: not a workdir of scripts/train.py "
                        f"(or one from before run.json was written); retrain or pass the "
                        f"right --workdir")
    cfg, seed = config_from_dict(info["model"]), int(info["seed"])
    dirs = _pretrained_dirs(info)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        steps = ckpt.manager.all_steps()
        if not steps:
            raise UserError(f"no checkpoint in {workdir}/checkpoints: train first (or pass "
                            f"--workdir of a run that wrote one)")
        step = ckpt.latest_step() if step is None else step
        if step not in steps:
            raise UserError(f"--step={step}: {workdir}/checkpoints holds steps {sorted(steps)}")
        assert step is not None  # one of steps
        filters = (trainable_filter(cfg), ...)
        key = jax.random.key(seed)
        tx = optimizer_from_settings(learning_rate_schedule(1))
        graphdef, tr, fr = abstract_split(MultimodalModel, (cfg,), key, filters)
        device = jax.devices()[0]
        on_device = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                   sharding=SingleDeviceSharding(device))
        like = jax.tree.map(on_device, whole_model_state(
            tr, jax.eval_shape(tx.init, tr), jax.ShapeDtypeStruct((), jnp.int32)))
        named, _ = ckpt.restore(step, single_logical(like))  # either path's checkpoints
        trainable = single_from_logical(like, named).stages[WHOLE_MODEL].master
    finally:
        ckpt.close()
    if jax.tree.leaves(fr):  # frozen parameters: the init, then the pretrained files
        whole = nnx.merge(*init_split(MultimodalModel, (cfg,), key, filters[:1] + (...,)))
        load_pretrained_dirs(whole, dirs)
        fr = split_model(whole, filters[0])[2]
    return cfg, nnx.merge(graphdef, trainable, fr), step, dirs


LAYOUTS = {"tf4": ("legacy", "flat"), "tf5": ("legacy", "nested")}  # Qwen2-VL: names, config


def export_model(cfg: MLLMConfig, pure: dict, out, max_shard_bytes: int = MAX_SHARD_BYTES,
                 sources: dict | None = None, layout: str | None = None) -> dict[str, Path]:
    """Write each unit of a `MultimodalModel`-layout pure dict: out/llm, out/<encoder> as HF
    checkpoints, the rest into out/mmjax_extra.safetensors. -> {unit: directory}.
    `sources` {unit: pretrained dir}: a unit imported from a checkpoint is written back over
    it (every tensor the unit does not hold, e.g. a tower's layers above `feature_layer`,
    copied untouched: models/hf/write_back.py)."""
    out, sources = Path(out), sources or {}
    if any(getattr(e.encoder, "kind", None) == "qwen2_vl" for e in cfg.encoders):
        # Qwen2-VL / Qwen2.5-VL: one whole Qwen2(_5)VLForConditionalGeneration checkpoint,
        # over the one the run started from (pretrained.model, or .llm / .vision naming it)
        from mmjax.models.hf.qwen2_vl_pretrained import is_qwen2_vl_dir
        source = next((sources[u] for u in ("model", "llm", "vision")
                       if u in sources and is_qwen2_vl_dir(sources[u])), None)
        names, fmt = LAYOUTS[layout] if layout else (None, None)
        hf.save_qwen2_vl(pure, cfg, out / "model", names, fmt, max_shard_bytes, source=source)
        return {"model": out / "model"}
    if layout:
        raise UserError(f"--layout={layout}: only a Qwen2-VL or whole-LLaVA run is written "
                        f"in a chosen layout; the other units keep their source's (drop "
                        f"--layout)")
    written = {"llm": out / "llm"}
    hf.export_llm_safetensors(pure["llm"], cfg.llm, out / "llm", max_shard_bytes=max_shard_bytes,
                              source=sources.get("llm"))
    extra = {k: v for k, v in pure.items()
             if not is_llm(k) and not is_vae(k) and k != "encoders"}
    if cfg.vae is not None:  # the frozen VAE unit: back in diffusers' layout
        from mmjax.models.hf.vae import export_vae_safetensors
        export_vae_safetensors(pure[VAE_UNIT], cfg.vae, out / VAE_UNIT)
        written[VAE_UNIT] = out / VAE_UNIT
    for spec in cfg.encoders:
        enc, where = spec.encoder, out / spec.name
        tree = pure["encoders"][spec.name]
        if isinstance(enc, AudioConfig):
            hf.export_whisper_encoder_safetensors(tree, enc, where, max_shard_bytes,
                                                  source=sources.get(spec.name))
        elif enc.kind == "vit":
            hf.export_vit_safetensors(tree, enc, where, max_shard_bytes,
                                      source=sources.get(spec.name))
        else:  # the packed NaViT-style ViT: no HF tower holds it
            extra.setdefault("encoders", {})[spec.name] = tree
            continue
        written[spec.name] = where
    return save_extra(out, _flatten(extra), written)


def export_workdir(workdir: str, out, step: int | None = None,
                   max_shard_bytes: int = MAX_SHARD_BYTES, dtype: str | None = None,
                   layout: str | None = None, adapter: bool = False,
                   merge: bool = False) -> dict[str, Path]:
    """-> {unit: where it went}. A run started from a whole LLaVA checkpoint
    (`pretrained.model`) is written whole, over that checkpoint: OUT/model. Every checkpoint
    keeps its source's dtype and layout unless `dtype` ("float32", "bfloat16", "float16")
    or `layout` ("tf4", "tf5": a Qwen2-VL or whole-LLaVA run's) asks otherwise. A LoRA run
    takes `adapter` (its peft adapter, train/export_lora.py) or `merge` (the base, adapters
    merged)."""
    from mmjax.train.export_lora import export_adapter, lora_mode, merged
    from mmjax.models.hf.cast import _np_dtype, cast_checkpoint, cast_file

    if dtype is not None:
        _np_dtype(dtype)  # refused before anything is restored or written
    if layout is not None and layout not in LAYOUTS:
        raise UserError(f"--layout={layout!r}: use one of {', '.join(LAYOUTS)} (or leave it "
                        f"unset to keep the source's)")
    cfg, model, _, dirs = restore_model(workdir, step)
    mode = lora_mode(cfg, adapter, merge)
    if mode == "adapter":
        if dtype is not None or layout is not None:
            raise UserError("--adapter writes the adapter as trained (float32, peft's names): "
                            "drop --dtype / --layout")
        return export_adapter(cfg, model, out, dirs)
    if mode == "merge":
        cfg, model = merged(cfg, model)
    if "model" in dirs:  # a whole LLaVA: its source's layout, or transformers `layout`'s
        hf.save_llava(model, cfg, Path(out) / "model", source=dirs["model"],
                      max_shard_bytes=max_shard_bytes, layout=layout)
        written = {"model": Path(out) / "model"}
    else:
        written = export_model(cfg, _pure(model), out, max_shard_bytes, dirs, layout)
    if dtype is not None:
        for unit, where in written.items():  # mmjax_extra.safetensors too: one dtype
            cast_checkpoint(where, dtype) if Path(where).is_dir() else cast_file(where, dtype)
    return written
