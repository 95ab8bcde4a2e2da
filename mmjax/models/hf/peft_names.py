"""The names peft gives a model's adapters: `base_model.model.` + the module name the
transformers model has at run time (not the checkpoint's tensor name: transformers 5 loads
an old LLaVA or Qwen2-VL layout under its own module names) + `.lora_A.weight` /
`.lora_B.weight`. `adapter_table` maps those module names to our base weights and back."""
from __future__ import annotations

from mmjax.models.config import LLMConfig, MLLMConfig
from mmjax.models.hf.checkpoint import Entry
from mmjax.models.lora_merge import DECODER_WEIGHTS
from mmjax.models.units import LLM_UNIT

PREFIX = "base_model.model."
# LlavaForConditionalGeneration's module names: transformers >= 4.52 (5 included), and older
LLAVA_MODULES = {"tower": "model.vision_tower.", "projector": "model.multi_modal_projector.",
                 "llm": "model.language_model.", "head": "lm_head.weight"}
LLAVA_MODULES_OLD = {"tower": "vision_tower.vision_model.", "projector": "multi_modal_projector.",
                     "llm": "language_model.model.", "head": "language_model.lm_head.weight"}
# Qwen2VL / Qwen2_5_VLForConditionalGeneration's: transformers >= 4.52 (5 included), and
# older (its "legacy" tensor names); the tower's prefix stops at its blocks (a regex on
# "model.visual." would also pick patch_embed.proj)
QWEN2_VL_MODULES = {"tower": "model.visual.blocks.", "llm": "model.language_model."}
_PROJECTION_OF = {v: k for k, v in DECODER_WEIGHTS.items()}


def is_qwen2_vl(cfg) -> bool:
    return isinstance(cfg, MLLMConfig) and any(
        getattr(e.encoder, "kind", None) == "qwen2_vl" for e in cfg.encoders)


def runtime_entries(cfg, old: bool = False) -> list[Entry]:
    """The base weights of a model `hf.load` builds under transformers' module names."""
    from mmjax.models.hf.llava import llava_entries
    from mmjax.models.hf.llm import llm_entries
    from mmjax.models.hf.qwen2_vl import qwen2_vl_entries

    if isinstance(cfg, LLMConfig):
        return llm_entries(cfg)
    if is_qwen2_vl(cfg):
        return qwen2_vl_entries(cfg, "legacy" if old else "modules")
    if isinstance(cfg, MLLMConfig):
        return llava_entries(cfg, LLAVA_MODULES_OLD if old else LLAVA_MODULES)
    raise ValueError(f"peft adapters: a {type(cfg).__name__} is not supported (a decoder "
                     f"LLM, a whole LLaVA or a whole Qwen2-VL)")


def model_modules(cfg) -> dict:
    """{part kind: transformers module-name prefix} of a whole model (current names)."""
    return QWEN2_VL_MODULES if is_qwen2_vl(cfg) else LLAVA_MODULES


def auto_mapping(cfg) -> dict:
    """peft's `auto_mapping` of a whole model's adapter: its transformers class."""
    if not is_qwen2_vl(cfg):
        return {"base_model_class": "LlavaForConditionalGeneration",
                "parent_library": "transformers.models.llava.modeling_llava"}
    from mmjax.models.hf.qwen2_vl import ARCHITECTURES

    kind = cfg.name if cfg.name in ARCHITECTURES.values() else (
        "qwen2_5_vl" if cfg.encoder("vision").encoder.gated_mlp else "qwen2_vl")
    cls = {v: k for k, v in ARCHITECTURES.items()}[kind]
    return {"base_model_class": cls, "parent_library": f"transformers.models.{kind}."
                                                       f"modeling_{kind}"}


def part_and_projection(path: tuple) -> tuple[str, str]:
    """Our base weight path -> (part: "llm" / an encoder's tower / "<enc>.projector",
    projection name of models/lora_config.py)."""
    if path[0] == "projectors":
        return path[1] + ".projector", path[2]
    if path[0] == "encoders":
        return path[1], path[-2]
    return LLM_UNIT, _PROJECTION_OF[path[-1]]


def adapter_table(cfg, old: bool = False) -> dict:
    """{transformers module name: (our base weight path, its Entry)} of every projection
    LoRA can adapt (an nn.Linear held as one of our weights, not a fused block; a
    projector's only when it is kind "mlp")."""
    mlp = {e.name for e in getattr(cfg, "encoders", ()) if e.projector.kind == "mlp"}
    out = {}
    for e in runtime_entries(cfg, old):
        if not (e.transpose and e.rows is None and e.hf.endswith(".weight")):
            continue
        if e.path[-1] in DECODER_WEIGHTS.values() or (e.path[-1] == "kernel" and (
                (e.path[0] == "projectors" and e.path[1] in mlp) or "layers" in e.path)):
            out[e.hf[: -len(".weight")]] = (e.path, e)
    return out


def projector_module(cfg) -> str:
    """The transformers module peft's `modules_to_save` names for a LLaVA projector."""
    return LLAVA_MODULES["projector"].split(".")[1]
