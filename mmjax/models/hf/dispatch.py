"""One entry point for a local Hugging Face directory: `load` builds the matching mmjax
module from config.json and its safetensors; `hf_forward` runs it with HF's input and
output names, which is how a user checks an import against transformers."""
from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.audio import AudioEncoder
from mmjax.models.config import AudioConfig, VisionConfig
from mmjax.models.hf.checkpoint import apply_to_module, read_config
from mmjax.models.hf.llm import LLM_TYPES, config_from_hf, load_llm_safetensors
from mmjax.models.hf.vision import VISION_TYPES, load_vit_safetensors, vision_config_from_hf
from mmjax.models.hf.qwen2_vl import QWEN_VL_TYPES, load_qwen2_vl, model_type_of, save_qwen2_vl
from mmjax.models.hf.qwen2_vl_forward import qwen2_vl_forward
from mmjax.models.hf.whisper import audio_config_from_hf, load_whisper_encoder_safetensors
from mmjax.models.hf.llava import load_llava, save_llava
from mmjax.models.hf.llava_forward import hf_patches, llava_forward
from mmjax.models.llm import LLM
from mmjax.models.mllm import MultimodalModel
from mmjax.models.vit import StandardViT

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text",
                  "Phi3ForCausalLM": "phi3", "MixtralForCausalLM": "mixtral",
                  "CLIPModel": "clip",
                  "CLIPVisionModel": "clip_vision_model", "SiglipModel": "siglip",
                  "SiglipVisionModel": "siglip_vision_model", "WhisperModel": "whisper",
                  "WhisperForConditionalGeneration": "whisper",
                  "LlavaForConditionalGeneration": "llava",
                  "Qwen2VLForConditionalGeneration": "qwen2_vl",
                  "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl"}
# every model_type `load` reads
SUPPORTED = LLM_TYPES + VISION_TYPES + ("whisper", "llava") + QWEN_VL_TYPES


def model_type(config) -> str:
    """config.json's model_type, or the one its `architectures` implies; ValueError if neither
    names a supported family."""
    c = read_config(config)
    kind = c.get("model_type") or next(
        (_ARCHITECTURES[a] for a in c.get("architectures", []) if a in _ARCHITECTURES), None)
    experts = next((k for k in ("num_local_experts", "num_experts") if c.get(k)), None)
    if kind == "mixtral" or experts:
        key = experts or "num_local_experts"
        raise ValueError(f"config.json {key}={c.get(key)!r} (model_type={kind!r}): "
                         f"mixture-of-experts layers are not in mmjax; supported dense LLMs: "
                         f"{', '.join(LLM_TYPES)}")
    if kind not in SUPPORTED:
        raise ValueError(f"config.json model_type={kind!r} (architectures="
                         f"{c.get('architectures')}): supported: {', '.join(SUPPORTED)}")
    return kind


def config_for(path, **vision_options):
    """The mmjax config (LLMConfig, VisionConfig, AudioConfig, or the MLLMConfig of a whole
    LLaVA / Qwen2-VL) of an HF directory."""
    c = dict(read_config(path))
    c["model_type"] = model_type(c)
    if c["model_type"] in LLM_TYPES:
        return config_from_hf(c)
    if c["model_type"] in VISION_TYPES:
        return vision_config_from_hf(c, **vision_options)
    if c["model_type"] in QWEN_VL_TYPES + ("llava",) and vision_options:
        raise ValueError(f"config_for: {sorted(vision_options)} do not apply to a whole "
                         f"{c['model_type']} checkpoint (its config.json describes the tower)")
    if c["model_type"] in QWEN_VL_TYPES:
        from mmjax.models.hf.qwen2_vl import qwen2_vl_config_from_hf
        return qwen2_vl_config_from_hf(c)
    if c["model_type"] == "llava":
        from mmjax.models.hf.llava import llava_config_from_hf
        return llava_config_from_hf(c)[0]
    return audio_config_from_hf(c)


def load_pure(path, cfg, start: int = 0, end: int | None = None, dtype=np.float32) -> dict:
    """The pure parameter dict of layers [start, end) of the module `cfg` describes."""
    if isinstance(cfg, VisionConfig):
        return load_vit_safetensors(path, cfg, start, end, dtype)
    if isinstance(cfg, AudioConfig):
        return load_whisper_encoder_safetensors(path, cfg, start, end, dtype)
    return load_llm_safetensors(path, cfg, start, end, dtype)


def build_module(cfg, key=None, start: int = 0, end: int | None = None):
    """An abstract (no random init) module for `cfg`, to load weights into."""
    key = jax.random.key(0) if key is None else key
    kind = (StandardViT if isinstance(cfg, VisionConfig) else
            AudioEncoder if isinstance(cfg, AudioConfig) else LLM)
    return nnx.eval_shape(lambda: kind(cfg, key, start, end))


def load(path, dtype="float32", adapter=None, **vision_options):
    """Local HF directory (config.json + model.safetensors, or shards with
    model.safetensors.index.json) -> (module, config). Dispatches on model_type /
    architectures: llama, mistral, qwen2, qwen3, gemma2, gemma3_text, phi3 -> `LLM`; clip(_vision_model), siglip(_vision_model)
    -> `StandardViT` (vision tower); whisper -> `AudioEncoder` (encoder); llava
    (LlavaForConditionalGeneration, any transformers layout) -> `MultimodalModel` with HF's
    semantics (hf/llava.py); qwen2_vl / qwen2_5_vl (whole Qwen2VL /
    Qwen2_5_VLForConditionalGeneration checkpoints) -> `MultimodalModel` (`hf/qwen2_vl.py`).
    Parameters are cast to `dtype`. `vision_options`: feature_layer, max_images (vision
    only). The module remembers its source (`hf_source`), which `save` writes over.
    `adapter`: a peft LoRA adapter directory applied unmerged (hf/peft.py): the module gets
    adapters beside the projections it targets and the config their `LoRAConfig`s."""
    if model_type_of(read_config(path)) is not None:
        if vision_options:
            raise ValueError(f"load: {sorted(vision_options)} do not apply to a Qwen2-VL "
                             f"checkpoint (its config.json describes the tower)")
        module, cfg = load_qwen2_vl(path, "float32" if adapter is not None else dtype)
        if adapter is None:
            return module, cfg
        from mmjax.models.hf.peft import apply_adapter
        module, cfg = apply_adapter(module, cfg, adapter)
        return _cast(module, dtype), cfg
    if model_type(path) == "llava":
        if vision_options:
            raise ValueError(f"load: {sorted(vision_options)} do not apply to a LLaVA "
                             f"checkpoint (its config.json names the feature layer)")
        module, cfg, facts = load_llava(path)
        module.hf_image_token = facts["image_token_index"]
    else:
        cfg = config_for(path, **vision_options)
        module = apply_to_module(build_module(cfg), load_pure(path, cfg))
    module.hf_source = str(Path(path).resolve())
    if adapter is not None:
        from mmjax.models.hf.peft import apply_adapter
        module, cfg = apply_adapter(module, cfg, adapter)
    return _cast(module, dtype), cfg


def _cast(module, dtype):
    if jnp.dtype(dtype) != jnp.float32:
        state = nnx.state(module, nnx.Param)
        nnx.update(module, jax.tree.map(lambda a: a.astype(dtype), state))
    return module


@nnx.jit
def _llm_logits(module, tokens, allowed):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return module(tokens, positions, allowed)


@nnx.jit
def _vit_states(module, pixel_values):
    patches, seg, pos = hf_patches(pixel_values, module.cfg.patch_size)
    x = module.run_layers(module.embed(patches, seg, pos), seg)
    if module.cfg.class_token:  # HF order: class token first
        x = jnp.concatenate([module.class_tokens(x), x[:, : patches.shape[1]]], axis=1)
    return x if module.final_ln is None else module.final_ln(x)


@nnx.jit
def _whisper_states(module, input_features):
    mels = input_features.transpose(0, 2, 1)
    frame_len = jnp.full((mels.shape[0],), mels.shape[1], jnp.int32)
    return module(mels, frame_len)


def hf_forward(module, **inputs) -> dict:
    """Run a module `load` built with HF's inputs; -> dict with HF's output names.

    LLM: input_ids [B, S] (attention_mask [B, S], 1 = token, optional) -> logits.
    Vision tower: pixel_values [B, C, H, W] -> last_hidden_state [B, (1 +) patches, d]
    (class token first for CLIP; other sizes than the native one interpolate the
    positions as HF's interpolate_pos_encoding=True does); with feature_layer k the
    key is f"hidden_states[{k}]".
    Whisper encoder: input_features [B, n_mels, 2 * max_source_positions] -> last_hidden_state.
    Qwen2-VL / Qwen2.5-VL (`MultimodalModel` with a qwen2_vl tower): input_ids,
    attention_mask, pixel_values [patches, C*t*p*p], image_grid_thw [images, 3],
    mm_token_type_ids (default: 1 at the image token) -> logits.
    """
    if _is_qwen2_vl(module):
        return qwen2_vl_forward(module, **inputs)
    if isinstance(module, MultimodalModel):
        image_token = getattr(module, "hf_image_token", None)  # set by hf.load
        if image_token is None:
            raise ValueError("hf_forward: this MultimodalModel was not loaded from a LLaVA "
                             "checkpoint (hf.load): its image token id is unknown")
        ids, pixels = inputs.pop("input_ids"), inputs.pop("pixel_values")
        out = {"logits": llava_forward(module, image_token, ids, pixels,
                                       inputs.pop("attention_mask", None))}
    elif isinstance(module, LLM):
        tokens = jnp.asarray(inputs.pop("input_ids"))
        s = tokens.shape[1]
        allowed = jnp.tril(jnp.ones((s, s), bool))[None]
        if "attention_mask" in inputs:
            allowed = allowed & (jnp.asarray(inputs.pop("attention_mask")) != 0)[:, None, :]
        out = {"logits": _llm_logits(module, tokens, allowed)}
    elif isinstance(module, StandardViT):
        x = _vit_states(module, jnp.asarray(inputs.pop("pixel_values"), jnp.float32))
        k = module.cfg.feature_layer
        out = {"last_hidden_state" if k is None else f"hidden_states[{k}]": x}
    elif isinstance(module, AudioEncoder):
        feats = jnp.asarray(inputs.pop("input_features"), jnp.float32)
        frames = 2 * module.cfg.max_source_positions
        if feats.shape[-1] != frames:
            raise ValueError(f"input_features has {feats.shape[-1]} frames; Whisper takes "
                             f"exactly {frames} (pad to 2 * max_source_positions, as HF does)")
        out = {"last_hidden_state": _whisper_states(module, feats)}
    else:
        raise TypeError(f"hf_forward: {type(module).__name__} is not a module `load` builds")
    if inputs:
        raise ValueError(f"hf_forward: unsupported inputs {sorted(inputs)} for "
                         f"{type(module).__name__}")
    return out


def _is_qwen2_vl(module) -> bool:
    return isinstance(module, MultimodalModel) and any(
        getattr(e.encoder, "kind", None) == "qwen2_vl" for e in module.cfg.encoders)


def save(module, config, out_dir, source=None, max_shard_bytes: int | None = 5 * 10 ** 9,
         **options):
    """Write a module `load` built (or one of the same kinds) as a transformers checkpoint:
    the tensor names, shapes and config.json `save_pretrained` writes for its class.
    `source` (default: the directory `load` read it from, if any): that checkpoint is
    written again with the module's tensors in place and every other tensor copied, so a
    part of a larger checkpoint (a tower of a CLIPModel, a Whisper encoder) goes back into
    the original class. Shards above `max_shard_bytes` (5 GB, as save_pretrained) with
    model.safetensors.index.json. `options`: image_token_index (a LLaVA model without a
    source), layout ("tf4" / "tf5": a LLaVA written as that transformers writes it)."""
    from mmjax.models.hf.vision import export_vit_safetensors
    from mmjax.models.hf.whisper import export_whisper_encoder_safetensors
    from mmjax.models.hf.llm import export_llm_safetensors
    from mmjax.models.lora import LoRAParam

    if isinstance(module, nnx.Module) and jax.tree.leaves(nnx.state(module, LoRAParam)):
        raise ValueError("save: the module carries LoRA adapters, which a base checkpoint "
                         "would drop: write them with hf.save_adapter, or merge them first "
                         "(mmjax.models.lora_merge.merged_module)")

    if _is_qwen2_vl(module):  # over its source, in its layouts (hf_source)
        extra = sorted(set(options) - {"names", "config_format", "dtype"})
        if extra:
            raise ValueError(f"save: options {extra} do not apply to a Qwen2-VL model (it "
                             f"takes names, config_format, dtype)")
        return save_qwen2_vl(module, config, out_dir, max_shard_bytes=max_shard_bytes,
                             source=source, **options)
    source = source if source is not None else getattr(module, "hf_source", None)
    if isinstance(module, MultimodalModel):
        token = options.pop("image_token_index", getattr(module, "hf_image_token", None))
        files = save_llava(module, config, out_dir, source, token, max_shard_bytes,
                           layout=options.pop("layout", None))
    elif isinstance(module, StandardViT):
        files = export_vit_safetensors(module, config, out_dir, max_shard_bytes, source=source)
    elif isinstance(module, AudioEncoder):
        files = export_whisper_encoder_safetensors(module, config, out_dir, max_shard_bytes,
                                                   source=source)
    elif isinstance(module, LLM):
        files = export_llm_safetensors(module, config, out_dir, max_shard_bytes=max_shard_bytes,
                                       source=source)
    else:
        raise TypeError(f"save: {type(module).__name__} is not a module `load` builds")
    if options:
        raise ValueError(f"save: unsupported options {sorted(options)}")
    return files
