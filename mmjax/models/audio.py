"""Whisper audio encoder over log-mel frames, as HF's WhisperEncoder computes it.

conv1d(k=3, pad 1) -> GELU -> conv1d(k=3, stride 2, pad 1) -> GELU -> + Whisper's fixed
position table `embed_positions` (initialised to `layers.whisper_sinusoids`, HF's init;
loaded from the checkpoint when it has one; never trained) -> pre-LN transformer with exact
GELU -> LayerNorm. A clip of T valid
frames gives ceil(T / 2) valid tokens; clips are padded to a bucketed frame capacity and
padding tokens are masked out of attention (HF runs full 3000-frame windows: a full window
here is the same computation). Buffers longer than `max_source_positions` tokens are refused.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.attention import segment_meta
from mmjax.models.config import AudioConfig
from mmjax.models.layers import EncoderBlock, LayerNorm, param, whisper_sinusoids, zeros
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range


def _conv1d(x, kernel, bias, stride):
    """x [N, T, C], kernel [3, C, D], 'same'-style padding of 1 on each side."""
    y = jax.lax.conv_general_dilated(x, kernel.astype(x.dtype), (stride,), [(1, 1)],
                                     dimension_numbers=("NWC", "WIO", "NWC"))
    return y + bias.astype(x.dtype)


def audio_token_mask(frame_len, num_tokens):
    """Valid-token mask [N, num_tokens] for clips with `frame_len` valid frames."""
    valid = (frame_len + 1) // 2
    return jnp.arange(num_tokens)[None, :] < valid[:, None]


class AudioEncoder(nnx.Module):
    def __init__(self, cfg: AudioConfig, key, start: int = 0, end: int | None = None):
        end, self.is_first, self.is_last = layer_range("audio layer", cfg.num_layers, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_embed, k_layers = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        d, m = cfg.hidden_size, cfg.num_mel_bins
        if self.is_first:
            k1, k2 = jax.random.split(k_embed)
            self.conv1_kernel = param(k1, (3, m, d), (3 * m) ** -0.5)
            self.conv1_bias = zeros((d,))
            self.conv2_kernel = param(k2, (3, d, d), (3 * d) ** -0.5)
            self.conv2_bias = zeros((d,))
            # Whisper's fixed position table (HF `embed_positions`); never trained:
            # `mllm.trainable_filter` leaves it out and `embed` stops its gradient.
            self.embed_positions = nnx.Param(whisper_sinusoids(cfg.max_source_positions, d))
        self.layers = nnx.List([
            EncoderBlock(jax.random.fold_in(k_layers, i), d, cfg.ffn_size, cfg.num_heads,
                         cfg.norm_eps, act="gelu", k_bias=False) for i in range(start, end)])
        self.final_ln = LayerNorm(d, cfg.norm_eps) if self.is_last else None

    def embed(self, mels, frame_len):
        # Zero the padding frames so results do not depend on what the buffer held there.
        keep = jnp.arange(mels.shape[1])[None, :] < frame_len[:, None]
        x = jnp.where(keep[..., None], mels, 0.0)
        x = jax.nn.gelu(_conv1d(x, self.conv1_kernel[...], self.conv1_bias[...], 1), approximate=False)
        x = jnp.where(keep[..., None], x, 0.0)  # output independent of the bucket capacity
        x = jax.nn.gelu(_conv1d(x, self.conv2_kernel[...], self.conv2_bias[...], 2), approximate=False)
        if x.shape[1] > self.cfg.max_source_positions:
            raise ValueError(f"audio: {mels.shape[1]} frames give {x.shape[1]} tokens, more "
                             f"than max_source_positions={self.cfg.max_source_positions}; use "
                             f"audio_frame_caps <= {2 * self.cfg.max_source_positions}")
        pos = jax.lax.stop_gradient(self.embed_positions[...][: x.shape[1]])
        return x + pos.astype(x.dtype)

    def run_layers(self, x, frame_len, attention_impl: str = "auto"):
        meta = segment_meta(audio_token_mask(frame_len, x.shape[1]).astype(jnp.int32))
        return run_stack(self.layers, x, lambda layer, h: layer(h, meta, attention_impl),
                         self.cfg.scan_layers, remat=self.cfg.remat)

    def finish(self, x):
        return self.final_ln(x)

    def __call__(self, mels, frame_len, attention_impl: str = "auto"):
        x = self.run_layers(self.embed(mels, frame_len), frame_len, attention_impl)
        return self.finish(x)
