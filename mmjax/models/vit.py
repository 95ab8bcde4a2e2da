"""Standard ViT (CLIP / SigLIP vision towers) over packed patch buffers.

What differs from the NaViT-style `VisionEncoder`: a learned 1-D position table over the
native (image_size / patch_size)^2 grid, bicubically resampled to each image's own grid
exactly as HF's `interpolate_pos_encoding` does (PyTorch `interpolate(mode="bicubic",
align_corners=False)`; at the native grid the weights are (0, 1, 0, 0), so the table itself);
an optional class token (CLIP) with position 0; CLIP's `pre_layrnorm`; the block activation
(`quick_gelu`, `gelu_tanh`); a final LayerNorm only where the tower has one (SigLIP).

Packing: the inputs are the same buffers as the packed ViT (`patches`, `patch_seg` 1-based
image id, `patch_pos` (row, col)). An image's grid size is read from its own patches (the
largest row / col in its segment). Class tokens go into `max_images` slots appended after
the T patch slots of each buffer row (slot j belongs to image j + 1); attention does not
depend on token order and every position is explicit, so this equals HF's prepending. The
slots are dropped again by `finish`, so the projector sees [N, T, d] like the packed ViT:
LLaVA's feature (the patch tokens, class token dropped). `cfg.feature_layer` picks the
hidden state it reads (`cfg.depth` layers are built; -2 is LLaVA's penultimate layer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.attention import segment_mask, segment_meta
from mmjax.models.config import VisionConfig
from mmjax.models.layers import Dense, EncoderBlock, LayerNorm, param
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range

_A = -0.75  # PyTorch's bicubic coefficient


def _cubic_weights(t):
    """PyTorch upsample_bicubic2d weights of source taps floor-1 .. floor+2 at fraction t."""
    near = lambda x: ((_A + 2) * x - (_A + 3)) * x * x + 1
    far = lambda x: ((_A * x - 5 * _A) * x + 8 * _A) * x - 4 * _A
    return jnp.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def bicubic_taps(dst, out_size, in_size: int):
    """Source indices [..., 4] and weights [..., 4] of output index `dst` when resizing
    `in_size` -> `out_size` (arrays) with align_corners=False, borders clamped."""
    src = (dst.astype(jnp.float32) + 0.5) * (in_size / out_size.astype(jnp.float32)) - 0.5
    base = jnp.floor(src)
    idx = base.astype(jnp.int32)[..., None] + jnp.arange(-1, 3)
    return jnp.clip(idx, 0, in_size - 1), _cubic_weights(src - base)


def image_grids(patch_seg, patch_pos):
    """Per patch, its image's grid (rows, cols) [N, T, 2]: 1 + the largest row / col over
    the patches of its segment."""
    same = segment_mask(patch_seg)[..., None]  # [N, T, T, 1]
    return 1 + jnp.max(jnp.where(same, patch_pos[:, None, :, :], 0), axis=2)


def class_slot_segments(patch_seg, max_images: int):
    """Segment ids [N, K] of the class-token slots: j + 1 where image j + 1 is present."""
    ids = jnp.arange(1, max_images + 1)
    present = jnp.any(patch_seg[:, :, None] == ids, axis=1)
    return jnp.where(present, ids, 0).astype(patch_seg.dtype)


class StandardViT(nnx.Module):
    def __init__(self, cfg: VisionConfig, key, start: int = 0, end: int | None = None):
        end, self.is_first, self.is_last = layer_range("vision layer", cfg.depth, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_embed, k_layers = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
        d = cfg.hidden_size
        if self.is_first:
            ke = jax.random.split(k_embed, 3)
            self.patch_embed = Dense(ke[0], cfg.patch_dim, d, bias=cfg.patch_bias)
            self.class_embed = param(ke[1], (d,)) if cfg.class_token else None
            self.pos_embed = param(ke[2], (cfg.num_positions, d))
            self.pre_ln = LayerNorm(d, cfg.norm_eps) if cfg.pre_norm else None
        self.layers = nnx.List([
            EncoderBlock(jax.random.fold_in(k_layers, i), d, cfg.ffn_size, cfg.num_heads,
                         cfg.norm_eps, cfg.act, lora=cfg.lora) for i in range(start, end)])
        self.final_ln = (LayerNorm(d, cfg.norm_eps)
                         if self.is_last and cfg.final_norm else None)

    def _positions(self, patch_seg, patch_pos, dtype):
        """Each patch's bicubically resampled table row [N, T, d] (HF interpolate_pos_encoding):
        separable per-axis weights over the native grid, then one matmul with the table."""
        g0, off = self.cfg.native_grid, int(self.cfg.class_token)
        table = self.pos_embed[...][off:].astype(jnp.float32)  # [g0 * g0, d]
        grid = image_grids(patch_seg, patch_pos)

        def axis_weights(dst, size):  # [N, T, g0]: the 4 taps' weights, summed per source
            idx, w = bicubic_taps(dst, size, g0)
            return jnp.einsum("ntk,ntkg->ntg", w, jax.nn.one_hot(idx, g0, dtype=jnp.float32))

        rows = axis_weights(patch_pos[..., 0], grid[..., 0])
        cols = axis_weights(patch_pos[..., 1], grid[..., 1])
        weights = (rows[..., :, None] * cols[..., None, :]).reshape(*rows.shape[:2], g0 * g0)
        return jnp.einsum("ntp,pd->ntd", weights, table).astype(dtype)

    def embed(self, patches, patch_seg, patch_pos):
        x = self.patch_embed(patches)
        x = x + self._positions(patch_seg, patch_pos, x.dtype)
        if self.class_embed is not None:
            n, k = x.shape[0], self.cfg.max_images
            cls = (self.class_embed[...] + self.pos_embed[...][0]).astype(x.dtype)
            x = jnp.concatenate([x, jnp.broadcast_to(cls, (n, k, x.shape[-1]))], axis=1)
        return x if self.pre_ln is None else self.pre_ln(x)

    def run_layers(self, x, patch_seg, attention_impl: str = "auto"):
        seg = patch_seg
        if self.cfg.class_token:
            seg = jnp.concatenate([seg, class_slot_segments(seg, self.cfg.max_images)], axis=1)
        meta = segment_meta(seg)
        return run_stack(self.layers, x, lambda layer, h: layer(h, meta, attention_impl),
                         self.cfg.scan_layers, remat=self.cfg.remat)

    def finish(self, x):
        """The projector's input: patch tokens only [N, T, d] (class slots dropped)."""
        if self.cfg.class_token:
            x = x[:, : x.shape[1] - self.cfg.max_images]
        return x if self.final_ln is None else self.final_ln(x)

    def class_tokens(self, x):
        """Class-token states [N, max_images, d] of a full sequence (before `finish`)."""
        return x[:, x.shape[1] - self.cfg.max_images:]

    def __call__(self, patches, patch_seg, patch_pos):
        return self.finish(self.run_layers(self.embed(patches, patch_seg, patch_pos), patch_seg))
