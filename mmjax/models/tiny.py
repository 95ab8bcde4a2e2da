"""Tiny configurations that train on a laptop CPU in seconds (tests, quick start)."""
from __future__ import annotations

import dataclasses

from mmjax.models.config import (AudioConfig, EncoderSpec, GeneratorConfig, LLMConfig,
                                 MLLMConfig, ProjectorConfig, VisionConfig)

TINY_LLM = LLMConfig(vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                     num_kv_heads=2, ffn_size=128, qkv_bias=True)
TINY_VISION = VisionConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                           patch_size=4, max_grid=16)
TINY_AUDIO = AudioConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                         num_mel_bins=16, max_source_positions=2048)
TINY_GENERATOR = GeneratorConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64,
                                 latent_size=8, latent_channels=4, patch_size=2)


def tiny() -> MLLMConfig:
    """DistTrain-shaped: vision encoder -> LLM -> diffusion generator."""
    return MLLMConfig(name="tiny", llm=TINY_LLM,
                      encoders=(EncoderSpec("vision", TINY_VISION, ProjectorConfig(downsample=1)),),
                      generator=TINY_GENERATOR)


def tiny_valm() -> MLLMConfig:
    """OrchMLLM-shaped: vision and audio encoders -> LLM."""
    return MLLMConfig(name="tiny_valm", llm=TINY_LLM,
                      encoders=(EncoderSpec("vision", TINY_VISION, ProjectorConfig(downsample=2)),
                                EncoderSpec("audio", TINY_AUDIO, ProjectorConfig(downsample=2))))


def _tiny_qwen(name: str, qwen25: bool) -> MLLMConfig:
    """Qwen2-VL-shaped (qwen25: Qwen2.5-VL's RMSNorm / gated blocks and window attention):
    native-resolution tower (patch 4, 2x2 merge, 2 frames per patch) -> patch merger ->
    an LLM with M-RoPE (sections 2/3/3 of its 8 frequencies)."""
    extra = dict(norm="rms", gated_mlp=True, act="silu", window_size=16,
                 fullatt_block_indexes=(1,)) if qwen25 else dict(act="quick_gelu")
    vision = VisionConfig(hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, patch_size=4,
                          max_grid=32, kind="qwen2_vl", post_norm=False, patch_bias=False,
                          temporal_patch_size=2, spatial_merge_size=2, **extra)
    llm = dataclasses.replace(TINY_LLM, mrope_section=(2, 3, 3))
    return MLLMConfig(name=name, llm=llm, encoders=(
        EncoderSpec("vision", vision, ProjectorConfig(kind="patch_merger", downsample=4)),))


def tiny_qwen2_vl() -> MLLMConfig:
    return _tiny_qwen("tiny_qwen2_vl", False)


def tiny_qwen2_5_vl() -> MLLMConfig:
    return _tiny_qwen("tiny_qwen2_5_vl", True)


TINY_CONFIGS = {"tiny": tiny, "tiny_valm": tiny_valm, "tiny_qwen2_vl": tiny_qwen2_vl,
                "tiny_qwen2_5_vl": tiny_qwen2_5_vl}
