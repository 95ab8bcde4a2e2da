"""ViT over packed variable-resolution images (NaViT-style patch packing).

Patches of several images share one fixed-capacity buffer; `patch_seg` (1-based image id
in the buffer, 0 = padding) keeps attention inside an image, and factorised learned 2-D
positions (`patch_pos` = (row, col) in the image's patch grid) let any aspect ratio through.
`VisionEncoder(cfg, key, start, end)` holds layers [start, end) for pipeline stages.
"""
from __future__ import annotations

import jax
from flax import nnx

from mmjax.models.attention import segment_meta, shared_tiles
from mmjax.models.config import VisionConfig
from mmjax.models.layers import Dense, EncoderBlock, LayerNorm, param
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range


class VisionEncoder(nnx.Module):
    def __init__(self, cfg: VisionConfig, key, start: int = 0, end: int | None = None):
        end, self.is_first, self.is_last = layer_range("vision layer", cfg.num_layers, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_embed, k_layers = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        d = cfg.hidden_size
        if self.is_first:
            ke = jax.random.split(k_embed, 3)
            self.patch_embed = Dense(ke[0], cfg.patch_dim, d)
            self.pos_row = param(ke[1], (cfg.max_grid, d))
            self.pos_col = param(ke[2], (cfg.max_grid, d))
        self.layers = nnx.List([
            EncoderBlock(jax.random.fold_in(k_layers, i), d, cfg.ffn_size, cfg.num_heads,
                         cfg.norm_eps, lora=cfg.lora) for i in range(start, end)])
        self.final_ln = LayerNorm(d, cfg.norm_eps) if self.is_last else None

    def embed(self, patches, patch_pos):
        x = self.patch_embed(patches)
        dt = x.dtype
        return (x + self.pos_row[...].astype(dt)[patch_pos[..., 0]]
                + self.pos_col[...].astype(dt)[patch_pos[..., 1]])

    def run_layers(self, x, patch_seg, attention_impl: str = "auto"):
        meta = segment_meta(patch_seg)
        tiles = shared_tiles(meta, attention_impl)  # Pallas block lists, once for all layers
        return run_stack(self.layers, x, lambda layer, h: layer(h, meta, attention_impl, tiles),
                         self.cfg.scan_layers, remat=self.cfg.remat)

    def finish(self, x):
        return self.final_ln(x)

    def __call__(self, patches, patch_seg, patch_pos, attention_impl: str = "auto"):
        x = self.run_layers(self.embed(patches, patch_pos), patch_seg, attention_impl)
        return self.finish(x)
