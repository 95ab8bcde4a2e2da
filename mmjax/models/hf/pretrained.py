"""Pretrained parts into a `MultimodalModel` (Cornstarch §3): the LLM and any encoder from
HF checkpoints; projectors (and anything not named) keep their init."""
from __future__ import annotations

from mmjax.models.hf.checkpoint import apply_to_module
from mmjax.models.hf.dispatch import load_pure


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
