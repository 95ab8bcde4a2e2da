"""Paper-scale named model configurations (no JAX), for planning and FLOP/byte counts.

- DistTrain (DistTrain §8, Table 1): Llama3-7B/13B/70B backbones (Llama3 vocabulary,
  128256) + ViT-Huge/14 (0.63B) + an SD-2.1-sized DiT generator (~0.87B; the paper's
  "Stable-Diffusion 2.1 (1B)") = MLLM-9B/15B/72B. 512x512 generation for 9B/15B,
  1024x1024 for 72B (latent side = image side / 8). Table 1's 7B/13B rows are the
  Llama-2-7B/13B shapes (6.74B/13.02B with Llama-2's 32000 vocabulary); with the Llama3
  vocabulary the paper names they hold 7.53B/14.00B, and the 70B row is Llama-3-70B
  (70.55B). The MLLM names add the *nominal* sizes (13 + 0.63 + 1 ~ 15), so MLLM-15B's
  published parts sum to 15.50B (14.00 + 0.63 + 0.87) whatever the generator and projector:
  3.3% over its name; tests compare it with that sum (tests/test_named_configs.py).
- OrchMLLM (OrchMLLM §8, Table 1): Qwen2 LLMs, ViT vision, Whisper audio encoders, MLP
  projectors with downsample rates vision 1/4/4 and audio 2/2/4 = MLLM-10B/18B/84B.
- Cornstarch (Cornstarch §6.1, Table 1): Llama-3 LLM (S 1.2B / M 8B / L 32B), EVA-CLIP vision
  (S 1B / M 8B / L 18B) and Whisper audio (S 1.4B / M 7B / L 15B) encoders. VLM-{S,M,L},
  ALM-{S,M,L} and VALM-{SS,SL,LS,LL} with the medium LLM; encoders and LLM frozen, the
  projector a single trainable linear layer (Cornstarch §6.1).

Where a table gives only layers and width, the FFN width and head count are chosen so the
module lands within 3% of the published size (tests/test_named_configs.py checks it): the
Whisper encoders keep Whisper's FFN of 4x the width, EVA-CLIP-S is EVA-CLIP-g (FFN 6144),
EVA-CLIP-M/L's FFN widths are chosen to reach 8B/18B.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Callable

from mmjax.errors import UserError
from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VisionConfig, with_overrides)

LLAMA3_VOCAB = 128256
QWEN2_VOCAB = 152064

# ---- shared modules ----------------------------------------------------------------------
VIT_HUGE_14 = VisionConfig(hidden_size=1280, num_layers=32, num_heads=16, ffn_size=5120,
                           patch_size=14)


def sd21_dit(latent_size: int) -> GeneratorConfig:
    """DiT with SD-2.1-UNet-like size (865M): width 1280 (the UNet's widest level), 24 blocks."""
    return GeneratorConfig(hidden_size=1280, num_layers=24, num_heads=16, ffn_size=5120,
                           latent_size=latent_size, latent_channels=4, patch_size=2)


# ---- DistTrain (DistTrain Table 1) ----------------------------------------------------------
def _llama3(layers, hidden, ffn, heads, groups) -> LLMConfig:
    return LLMConfig(vocab_size=LLAMA3_VOCAB, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=groups, ffn_size=ffn, rope_theta=500000.0)


def _disttrain(name: str, llm: LLMConfig, image_side: int) -> MLLMConfig:
    return MLLMConfig(name=name, llm=llm,
                      encoders=(EncoderSpec("vision", VIT_HUGE_14, ProjectorConfig(num_layers=2)),),
                      generator=sd21_dit(image_side // 8))


def disttrain_mllm_9b() -> MLLMConfig:
    return _disttrain("disttrain/mllm_9b", _llama3(32, 4096, 11008, 32, 32), 512)


def disttrain_mllm_9b_mid() -> MLLMConfig:
    """MLLM-9B's widths (Llama-2-7B's layer shapes and 32000 vocabulary, ViT-H/14, the
    DiT) with depth cut to LLM 2, ViT 2, DiT 1 layers: 0.78B parameters, 3.1 GB in fp32, a
    real-shaped model for runtime memory and sharded-initialisation checks on CPU."""
    cfg = _disttrain("disttrain/mllm_9b_mid", LLMConfig(
        vocab_size=32000, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=32,
        ffn_size=11008, rope_theta=500000.0), 512)
    return with_overrides(cfg, {"encoders.vision.encoder.num_layers": 2,
                                "generator.num_layers": 1})


def disttrain_mllm_15b() -> MLLMConfig:
    return _disttrain("disttrain/mllm_15b", _llama3(40, 5120, 13824, 40, 40), 512)


def disttrain_mllm_72b() -> MLLMConfig:
    return _disttrain("disttrain/mllm_72b", _llama3(80, 8192, 28672, 64, 8), 1024)


# ---- OrchMLLM (OrchMLLM Table 1) -----------------------------------------------------------
def _qwen2(layers, hidden, ffn, heads, kv) -> LLMConfig:
    return LLMConfig(vocab_size=QWEN2_VOCAB, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, ffn_size=ffn, qkv_bias=True,
                     rope_theta=1000000.0)


def _whisper(layers, hidden, ffn, heads, mels=128) -> AudioConfig:
    return AudioConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, ffn_size=ffn,
                       num_mel_bins=mels)


def _orchmllm(name, llm, vision, audio, vision_ds, audio_ds) -> MLLMConfig:
    return MLLMConfig(name=name, llm=llm, encoders=(
        EncoderSpec("vision", vision, ProjectorConfig(num_layers=2, downsample=vision_ds)),
        EncoderSpec("audio", audio, ProjectorConfig(num_layers=2, downsample=audio_ds))))


def orchmllm_mllm_10b() -> MLLMConfig:
    return _orchmllm("orchmllm/mllm_10b", _qwen2(28, 3584, 18944, 28, 4),
                     VisionConfig(hidden_size=2048, num_layers=36, num_heads=16, ffn_size=8192),
                     _whisper(32, 1280, 5120, 20), 1, 2)


def orchmllm_mllm_18b() -> MLLMConfig:
    return _orchmllm("orchmllm/mllm_18b", _qwen2(48, 5120, 13824, 40, 8),
                     VisionConfig(hidden_size=2400, num_layers=40, num_heads=16, ffn_size=9600),
                     _whisper(32, 1280, 5120, 20), 4, 2)


def orchmllm_mllm_84b() -> MLLMConfig:
    return _orchmllm("orchmllm/mllm_84b", _qwen2(80, 8192, 29568, 64, 8),
                     VisionConfig(hidden_size=3200, num_layers=45, num_heads=32, ffn_size=12800),
                     _whisper(48, 3072, 12288, 24), 4, 4)


# ---- Cornstarch (Cornstarch Table 1) ---------------------------------------------------------
CORNSTARCH_LLM = {
    "s": LLMConfig(vocab_size=LLAMA3_VOCAB, hidden_size=2048, num_layers=16, num_heads=32,
                   num_kv_heads=8, ffn_size=8192, tie_embeddings=True, rope_theta=500000.0),
    "m": _llama3(32, 4096, 14336, 32, 8),
    "l": _llama3(64, 5120, 27648, 40, 8),
}
CORNSTARCH_VISION = {  # EVA-CLIP
    "s": VisionConfig(hidden_size=1408, num_layers=40, num_heads=16, ffn_size=6144),
    "m": VisionConfig(hidden_size=4096, num_layers=32, num_heads=32, ffn_size=22016),
    "l": VisionConfig(hidden_size=5120, num_layers=48, num_heads=40, ffn_size=26368),
}
CORNSTARCH_AUDIO = {  # Whisper
    "s": _whisper(32, 1920, 7680, 20),  # Table 1: 32 layers, width 1920 (head dim 96)
    "m": _whisper(40, 3840, 15360, 32),
    "l": _whisper(48, 5120, 20480, 40),
}
_LINEAR = ProjectorConfig(num_layers=1)


def _cornstarch(kind: str, vision: str | None, audio: str | None) -> Callable[[], MLLMConfig]:
    suffix = (vision or "") + (audio or "")

    def build() -> MLLMConfig:
        encs = []
        if vision:
            encs.append(EncoderSpec("vision", CORNSTARCH_VISION[vision], _LINEAR, frozen=True))
        if audio:
            encs.append(EncoderSpec("audio", CORNSTARCH_AUDIO[audio], _LINEAR, frozen=True))
        return MLLMConfig(name=f"cornstarch/{kind}_{suffix}", llm=CORNSTARCH_LLM["m"],
                          encoders=tuple(encs), llm_frozen=True)

    build.__name__ = f"cornstarch_{kind}_{suffix}"
    build.__doc__ = f"Cornstarch {kind.upper()}-{suffix.upper()} (Cornstarch §6.1) with LLM-M."
    return build


_REGISTRY: dict[str, Callable[[], MLLMConfig]] = {
    "disttrain/mllm_9b": disttrain_mllm_9b,
    "disttrain/mllm_9b_mid": disttrain_mllm_9b_mid,
    "disttrain/mllm_15b": disttrain_mllm_15b,
    "disttrain/mllm_72b": disttrain_mllm_72b,
    "orchmllm/mllm_10b": orchmllm_mllm_10b,
    "orchmllm/mllm_18b": orchmllm_mllm_18b,
    "orchmllm/mllm_84b": orchmllm_mllm_84b,
}
for _s in "sml":
    _REGISTRY[f"cornstarch/vlm_{_s}"] = _cornstarch("vlm", _s, None)
    _REGISTRY[f"cornstarch/alm_{_s}"] = _cornstarch("alm", None, _s)
for _v, _a in ("ss", "sl", "ls", "ll"):
    _REGISTRY[f"cornstarch/valm_{_v}{_a}"] = _cornstarch("valm", _v, _a)

NAMED_CONFIGS = MappingProxyType(_REGISTRY)


def named_config(name: str, overrides: dict | None = None) -> MLLMConfig:
    """The named config with dotted-path `overrides` applied (config.with_overrides)."""
    if name not in NAMED_CONFIGS:
        raise UserError(f"model config {name!r} is unknown (choose one of "
                        f"{sorted(NAMED_CONFIGS)})")
    return with_overrides(NAMED_CONFIGS[name](), overrides)
