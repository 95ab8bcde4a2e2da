"""Tiny configurations that train on a laptop CPU in seconds (tests, quick start)."""
from __future__ import annotations

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


TINY_CONFIGS = {"tiny": tiny, "tiny_valm": tiny_valm}
