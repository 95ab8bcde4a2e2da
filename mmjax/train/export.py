"""A training checkpoint -> Hugging Face checkpoints (scripts/export_hf.py).

The workdir's run.json names the model config, plan and seed; the checkpoint is restored
into the same structure the trainer saved (one program's TrainState, or a plan's per-stage
trainable parameters and optimizer states, the frozen parts rebuilt as training built
them), the stages' parameters are put back into `MultimodalModel` layout, and each unit
with an HF counterpart is written: the LLM (Llama / Qwen2), CLIP / SigLIP-shaped towers
(`VisionConfig(kind="vit")`) and Whisper encoders. Projectors, the generator and packed
NaViT-style towers have no HF format: they go to `mmjax_extra.safetensors` (dotted names)
so nothing trained is dropped. A Qwen2-VL-shaped model (tower kind="qwen2_vl") is written
whole, as one Qwen2VL / Qwen2_5_VLForConditionalGeneration checkpoint in out/model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from mmjax.models import hf
from mmjax.models.config import AudioConfig, MLLMConfig, config_from_dict
from mmjax.models.hf.checkpoint import _flatten, _fmt
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.planner.plan import Plan
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.logical_state import (pipeline_load_logical, pipeline_logical,
                                       single_from_logical, single_logical)
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.step import TrainState, split_model

MAX_SHARD_BYTES = 5 * 10 ** 9  # HF's default shard size


def read_run_info(workdir: str) -> dict:
    path = os.path.join(workdir, "run.json")
    if not os.path.exists(path):
        raise ValueError(f"{path} does not exist: not a workdir of scripts/train.py (or one "
                         f"from before run.json was written); retrain or pass the right --workdir")
    with open(path) as f:
        return json.load(f)


def _pure(module) -> dict:
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def restore_params(workdir: str, step: int | None = None) -> tuple[MLLMConfig, dict, int]:
    """-> (model config, `MultimodalModel`-layout pure dict of all parameters, step)."""
    info = read_run_info(workdir)
    cfg, seed = config_from_dict(info["model"]), int(info["seed"])
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        steps = ckpt.manager.all_steps()
        step = ckpt.latest_step() if step is None else step
        if step is None or step not in steps:
            raise ValueError(f"--step={step}: {workdir}/checkpoints holds steps {sorted(steps)}")
        tx = optimizer_from_settings(learning_rate_schedule(1))
        if info["plan"] is None:
            graphdef, tr, fr = split_model(MultimodalModel(cfg, jax.random.key(seed)),
                                           trainable_filter(cfg))
            like = TrainState(jnp.zeros((), jnp.int32), tr, fr, tx.init(tr))
            named, _ = ckpt.restore(step, single_logical(like))  # the trainer's layout
            state = single_from_logical(like, named)
            return cfg, _pure(nnx.merge(graphdef, state.trainable, state.frozen)), step
        from mmjax.pipeline.reference_layout import to_reference_layout
        from mmjax.train.pipeline_step import PipelineStep
        plan = Plan.from_json(info["plan"])
        step_fn = PipelineStep(cfg, plan, learning_rate_schedule(1), seed=seed,
                               pretrained=info.get("pretrained"))  # frozen parts as trained
        named, _ = ckpt.restore(step, pipeline_logical(step_fn))  # the trainer's layout
        pipeline_load_logical(step_fn, named)
        stages = {sid: _pure(nnx.merge(st.graphdef, st.trainable, st.frozen))
                  for sid, st in step_fn.runtime.stages.items()}
        return cfg, to_reference_layout(plan, stages), step
    finally:
        ckpt.close()


def export_model(cfg: MLLMConfig, pure: dict, out, max_shard_bytes: int = MAX_SHARD_BYTES
                 ) -> dict[str, Path]:
    """Write each unit of a `MultimodalModel`-layout pure dict: out/llm, out/<encoder> as HF
    checkpoints, the rest into out/mmjax_extra.safetensors. -> {unit: directory}."""
    out = Path(out)
    if any(getattr(e.encoder, "kind", None) == "qwen2_vl" for e in cfg.encoders):
        # Qwen2-VL / Qwen2.5-VL: one whole Qwen2(_5)VLForConditionalGeneration checkpoint
        hf.save_qwen2_vl(pure, cfg, out / "model", max_shard_bytes=max_shard_bytes)
        return {"model": out / "model"}
    written = {"llm": out / "llm"}
    hf.export_llm_safetensors(pure["llm"], cfg.llm, out / "llm", max_shard_bytes=max_shard_bytes)
    extra = {k: v for k, v in pure.items() if k not in ("llm", "encoders")}
    for spec in cfg.encoders:
        enc, where = spec.encoder, out / spec.name
        tree = pure["encoders"][spec.name]
        if isinstance(enc, AudioConfig):
            hf.export_whisper_encoder_safetensors(tree, enc, where, max_shard_bytes)
        elif enc.kind == "vit" and enc.feature_layer is None:
            hf.export_vit_safetensors(tree, enc, where, max_shard_bytes)
        else:  # packed ViT, or a tower cut at feature_layer: no HF tower holds it
            extra.setdefault("encoders", {})[spec.name] = tree
            continue
        written[spec.name] = where
    flat = {_fmt(k): np.ascontiguousarray(np.asarray(jax.device_get(v)))
            for k, v in _flatten(extra).items()}
    if flat:
        save_file(flat, str(out / "mmjax_extra.safetensors"))
        written["extra"] = out / "mmjax_extra.safetensors"
    return written


def export_workdir(workdir: str, out, step: int | None = None,
                   max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Path]:
    cfg, pure, _ = restore_params(workdir, step)
    return export_model(cfg, pure, out, max_shard_bytes)
