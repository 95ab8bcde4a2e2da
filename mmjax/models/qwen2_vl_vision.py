"""Qwen2-VL / Qwen2.5-VL native-resolution ViT over packed patch buffers, and its merger.

Inputs are the packed-ViT buffers (`patches` [N, T, C*t*p*p] in HF's (c, t, py, px) feature
order, `patch_seg` 1-based image id, `patch_pos` (row, col) in the image's patch grid), with
each image's patches in HF's order: 2x2 merge blocks consecutive (`data/qwen2_vl_processor.py`).

- Patch embedding: HF's Conv3d (kernel = stride = (t, p, p), no bias) is one matmul over the
  flattened patch.
- 2-D RoPE (HF `VisionRotaryEmbedding`, axial): head_dim/4 frequencies theta^(-4i/head_dim);
  angles [row * f, col * f] rotate both halves of every head (rotate-half convention).
- Blocks: pre-norm attention (fused qkv with bias) + MLP. Qwen2-VL: LayerNorm, fc1/fc2 with
  quick_gelu. Qwen2.5-VL: RMSNorm, gate/up/down with SiLU (all with biases).
- Attention stays inside an image (HF's cu_seqlens); Qwen2.5-VL's window blocks stay inside
  a window of window_size/patch_size patches per side. HF reorders tokens so windows are
  contiguous (`get_window_index`) and undoes it after the merger; attention itself does not
  depend on token order and every position is explicit, so a window segment id per patch
  gives the same result with no reordering.
- LoRA (`VisionConfig.lora`): adapters beside qkv (one for the fused Linear, as peft's:
  A [d, r], B [r, 3d]), proj and the MLP's projections (models/lora.py).
- `finish`: the merger's ln_q (LayerNorm / RMSNorm); the projector (`PatchMergerMLP`)
  concatenates each 2x2 block's 4 consecutive tokens -> Linear -> exact GELU -> Linear.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.attention import bam_attention, segment_meta
from mmjax.models.config import ProjectorConfig, VisionConfig
from mmjax.models.layers import ACTIVATIONS, Dense, LayerNorm, RMSNorm
from mmjax.models.lora import layer_dropout
from mmjax.models.qwen2_vl_config import full_attention_layer, window_patches
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range

_WINDOW_BASE = 1 << 10  # window rows / cols per image side at most in a window segment id


def vision_rope_angles(patch_pos, head_dim: int, theta: float):
    """[N, T, head_dim/2] angles: [row * f, col * f] with f = theta^(-arange(0, d, 2)/d),
    d = head_dim / 2 (HF `compute_axial_rope_parameters`, computed in float32 as HF does)."""
    d = head_dim // 2
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, d, 2, dtype=np.float32) / np.float32(d)))
    pos = patch_pos.astype(jnp.float32)
    return jnp.concatenate([pos[..., 0:1] * inv, pos[..., 1:2] * inv], axis=-1)


def rotate(x, ang):
    """Rotate-half RoPE of x [N, T, H, D] by angles [N, T, D/2], in float32."""
    d = x.shape[-1]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def window_segments(patch_seg, patch_pos, side: int):
    """Per patch a segment id unique to (image, window): windows of `side` x `side` patches
    from the image's top-left corner (HF pads the merged grid to whole windows, then drops
    the padding, so edge windows are smaller; the same here). 0 stays padding."""
    wr, wc = patch_pos[..., 0] // side, patch_pos[..., 1] // side
    ids = (patch_seg * _WINDOW_BASE + wr) * _WINDOW_BASE + wc + 1
    return jnp.where(patch_seg > 0, ids, 0).astype(jnp.int32)


def _norm(cfg: VisionConfig, dim: int):
    return RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rms" else LayerNorm(dim, cfg.norm_eps)


class QwenVisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, key):
        d, f = cfg.hidden_size, cfg.ffn_size
        ks = jax.random.split(key, 5)
        self.num_heads, self.act, self.gated = cfg.num_heads, cfg.act, cfg.gated_mlp
        self.norm1, self.norm2 = _norm(cfg, d), _norm(cfg, d)
        dense = lambda i, n, din, dout: Dense(ks[i], din, dout, lora=cfg.lora, kind="qwen2_vl",
                                              name=n)
        self.qkv, self.proj = dense(0, "qkv", d, 3 * d), dense(1, "proj", d, d)
        if cfg.gated_mlp:
            self.gate, self.up = dense(2, "gate", d, f), dense(3, "up", d, f)
            self.down = dense(4, "down", f, d)
        else:
            self.fc1, self.fc2 = dense(2, "fc1", d, f), dense(3, "fc2", f, d)

    def __call__(self, x, ang, meta, attention_impl: str = "auto"):
        b, s, d = x.shape
        h = self.num_heads
        qkv = self.qkv(self.norm1(x)).reshape(b, s, 3, h, d // h)
        q, k = rotate(qkv[:, :, 0], ang), rotate(qkv[:, :, 1], ang)
        att = bam_attention(q, k, qkv[:, :, 2], meta, implementation=attention_impl)
        x = x + self.proj(att.reshape(b, s, d))
        y = self.norm2(x)
        act = ACTIVATIONS[self.act]
        if self.gated:
            return x + self.down(act(self.gate(y)) * self.up(y))
        return x + self.fc2(act(self.fc1(y)))


class Qwen2VLVision(nnx.Module):
    """Layers [start, end) of the tower (pipeline stages); patch embedding on the first,
    the merger's ln_q (`final_ln`) on the last."""

    def __init__(self, cfg: VisionConfig, key, start: int = 0, end: int | None = None):
        end, self.is_first, self.is_last = layer_range("vision layer", cfg.num_layers, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_embed, k_layers = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        d = cfg.hidden_size
        self.patch_embed = (Dense(jax.random.fold_in(k_embed, 0), cfg.patch_dim, d, bias=False)
                            if self.is_first else None)
        self.layers = nnx.List([QwenVisionBlock(cfg, jax.random.fold_in(k_layers, i))
                                for i in range(start, end)])
        self.final_ln = _norm(cfg, d) if self.is_last else None

    def embed(self, patches):
        return self.patch_embed(patches)

    def run_layers(self, x, patch_seg, patch_pos, attention_impl: str = "auto"):
        cfg = self.cfg
        ang = vision_rope_angles(patch_pos, cfg.hidden_size // cfg.num_heads, cfg.rope_theta)
        full = segment_meta(patch_seg)
        kinds = [full_attention_layer(cfg, i) for i in range(self.start, self.end)]
        if all(kinds):
            return run_stack(self.layers, x, lambda layer, h: layer(h, ang, full, attention_impl),
                             cfg.scan_layers, remat=cfg.remat)
        window = segment_meta(window_segments(patch_seg, patch_pos, window_patches(cfg)))
        for i, (layer, is_full) in enumerate(zip(self.layers, kinds)):  # windowed and full
            meta = full if is_full else window  # blocks alternate: one stack per layer, its
            with layer_dropout(i):  # LoRA dropout masks keyed by the layer's index too
                x = run_stack([layer], x, lambda lyr, h, m=meta: lyr(h, ang, m, attention_impl),
                              False, remat=cfg.remat)
        return x

    def finish(self, x):
        return self.final_ln(x)

    def __call__(self, patches, patch_seg, patch_pos, attention_impl: str = "auto"):
        return self.finish(self.run_layers(self.embed(patches), patch_seg, patch_pos,
                                           attention_impl))


class PatchMergerMLP(nnx.Module):
    """HF PatchMerger's MLP: `downsample` consecutive (normed) tokens concatenated ->
    Linear(r*e, hidden) -> exact GELU -> Linear(hidden, llm_dim); hidden defaults to r*e."""

    def __init__(self, cfg: ProjectorConfig, enc_dim: int, llm_dim: int, key):
        self.r = cfg.downsample
        din = enc_dim * cfg.downsample
        k1, k2 = jax.random.split(key)
        self.fc1 = Dense(k1, din, cfg.hidden_size or din)
        self.fc2 = Dense(k2, cfg.hidden_size or din, llm_dim)

    def __call__(self, x, segment_ids=None, attention_impl: str = "auto"):
        n, t, e = x.shape
        if t % self.r:
            raise ValueError(f"encoder capacity {t} not a multiple of downsample {self.r}")
        x = x.reshape(n, t // self.r, e * self.r)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))
