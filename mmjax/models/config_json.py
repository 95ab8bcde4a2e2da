"""An MLLMConfig to and from a JSON-able dict: a workdir's run_info.json keeps the model so
tools (scripts/export_hf.py, scripts/generate.py) rebuild it."""
from __future__ import annotations

import dataclasses

from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VAEConfig, VisionConfig)
from mmjax.models.lora_config import lora_from_dict


def config_to_dict(cfg: MLLMConfig) -> dict:
    """MLLMConfig -> JSON-able dict (encoders tagged "vision" / "audio"); `config_from_dict`
    inverts it. A workdir keeps it so tools (scripts/export_hf.py) rebuild the model."""
    d = dataclasses.asdict(cfg)
    for spec, e in zip(cfg.encoders, d["encoders"]):
        e["encoder"]["type"] = "vision" if isinstance(spec.encoder, VisionConfig) else "audio"
    return d


def config_from_dict(d: dict) -> MLLMConfig:
    rest = dict(d)  # the fields left once the nested configs are popped
    llm = dict(rest.pop("llm"))
    old = llm.pop("rope_llama3", None)  # workdirs written before rope_scaling
    if old is not None:
        llm["rope_scaling"] = ("llama3", *old)
    for key in ("rope_scaling", "sliding_layers", "mrope_section"):
        if llm.get(key) is not None:
            llm[key] = tuple(llm[key])
    llm["lora"] = lora_from_dict(llm.get("lora"))
    encoders = []
    for e in rest.pop("encoders"):
        enc = dict(e["encoder"])
        kind = VisionConfig if enc.pop("type") == "vision" else AudioConfig
        if "fullatt_block_indexes" in enc:
            enc["fullatt_block_indexes"] = tuple(enc["fullatt_block_indexes"])
        if kind is VisionConfig:
            enc["lora"] = lora_from_dict(enc.get("lora"))
        proj = {**e["projector"], "lora": lora_from_dict(e["projector"].get("lora"))}
        encoders.append(EncoderSpec(e["name"], kind(**enc), ProjectorConfig(**proj),
                                    e["frozen"], e["projector_frozen"]))
    gen = rest.pop("generator", None)
    gen = GeneratorConfig(**gen) if gen else None
    vae = rest.pop("vae", None)
    if vae:
        rest["vae"] = VAEConfig(**{**vae, "block_out_channels": tuple(vae["block_out_channels"])})
    if rest.get("image_markers") is not None:
        rest["image_markers"] = tuple(rest["image_markers"])
    return MLLMConfig(llm=LLMConfig(**llm), encoders=tuple(encoders), generator=gen, **rest)
