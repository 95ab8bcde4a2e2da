"""Qwen2-VL / Qwen2.5-VL settings checks and grid arithmetic (no JAX).

`VisionConfig(kind="qwen2_vl")` describes both towers; this module says which combinations
are Qwen2-VL's (LayerNorm blocks, plain MLP with quick_gelu, full attention per image) or
Qwen2.5-VL's (RMSNorm blocks, gated SiLU MLP, window attention except in
`fullatt_block_indexes`), and the M-RoPE frequency split an LLM may carry.
"""
from __future__ import annotations

import numpy as np

from mmjax.errors import UserError


def check_qwen2_vl_vision(cfg) -> None:
    """One-line UserError naming the field, for settings the Qwen2-VL tower does not have."""
    if cfg.class_token or cfg.pre_norm or cfg.post_norm or cfg.feature_layer is not None:
        raise UserError("VisionConfig(kind='qwen2_vl'): class_token, pre_norm, post_norm and "
                        "feature_layer must be off (the tower has none; its norm is the "
                        "patch_merger's ln_q)")
    if cfg.temporal_patch_size < 1 or cfg.spatial_merge_size < 1:
        raise UserError(f"VisionConfig.temporal_patch_size={cfg.temporal_patch_size} / "
                        f"spatial_merge_size={cfg.spatial_merge_size}: use positive integers")
    if cfg.norm not in ("layer", "rms"):
        raise UserError(f"VisionConfig.norm={cfg.norm!r}: use 'layer' (Qwen2-VL) or 'rms' "
                        f"(Qwen2.5-VL)")
    head_dim = cfg.hidden_size // cfg.num_heads
    if cfg.hidden_size % cfg.num_heads or head_dim % 4:
        raise UserError(f"VisionConfig.hidden_size={cfg.hidden_size} / num_heads="
                        f"{cfg.num_heads}: the 2-D RoPE needs a head dim divisible by 4")
    unit = cfg.patch_size * cfg.spatial_merge_size
    if cfg.window_size and cfg.window_size % unit:
        raise UserError(f"VisionConfig.window_size={cfg.window_size}: use a multiple of "
                        f"patch_size * spatial_merge_size = {unit} (0: no window attention)")
    bad = [i for i in cfg.fullatt_block_indexes if not 0 <= i < cfg.num_layers]
    if bad:
        raise UserError(f"VisionConfig.fullatt_block_indexes={cfg.fullatt_block_indexes}: "
                        f"{bad} outside 0..{cfg.num_layers - 1}")


def window_patches(cfg) -> int:
    """Patches per window side (window_size / patch_size); 0: no window attention."""
    return cfg.window_size // cfg.patch_size if cfg.window_size else 0


def full_attention_layer(cfg, layer: int) -> bool:
    """Does block `layer` attend over the whole image (else over its window)?"""
    return not cfg.window_size or layer in cfg.fullatt_block_indexes


def check_mrope(section, head_dim: int) -> None:
    if section is None:
        return
    if len(section) != 3 or sum(section) != head_dim // 2 or min(section) < 0:
        raise UserError(f"LLMConfig.mrope_section={tuple(section)}: use 3 sections (t, h, w) "
                        f"summing to head_dim / 2 = {head_dim // 2}")


def merged_grid(height: int, width: int, patch_size: int, merge: int) -> tuple[int, int]:
    """An image's LLM token grid (rows, cols) = patch grid / merge."""
    return height // patch_size // merge, width // patch_size // merge


def patch_positions(grid_h: int, grid_w: int, merge: int):
    """(row, col) [gh * gw, 2] of an image's patches in HF's order: merge x merge blocks
    row-major, the patches of a block consecutive (HF `get_vision_position_ids`)."""
    rows, cols = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")
    block = (grid_h // merge, merge, grid_w // merge, merge)
    order = lambda a: a.reshape(block).transpose(0, 2, 1, 3).reshape(-1)
    return np.stack([order(rows), order(cols)], axis=-1).astype(np.int32)


def vision_token_positions(start: int, merged_h: int, merged_w: int):
    """M-RoPE (t, h, w) [n, 3] of one image's LLM tokens starting at text position `start`
    (t = start, h = start + row, w = start + col); the text after it resumes at
    start + max(merged_h, merged_w) (HF `get_rope_index`)."""
    rows, cols = np.meshgrid(np.arange(merged_h), np.arange(merged_w), indexing="ij")
    t = np.full(merged_h * merged_w, start)
    return np.stack([t, start + rows.reshape(-1), start + cols.reshape(-1)], -1).astype(np.int32)


def mrope_positions(input_ids, mm_token_type_ids, image_grid_thw, merge: int,
                    attention_mask=None):
    """HF `Qwen2VLModel.get_rope_index` for text and images: [B, S, 3] positions. Runs of
    text count up by one; each run of image tokens takes the next grid of image_grid_thw
    (`vision_token_positions`). Masked positions (attention_mask 0) stay 0."""
    ids = np.asarray(input_ids)
    kinds = np.asarray(mm_token_type_ids)
    mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask)
    grids = iter(np.asarray(image_grid_thw).reshape(-1, 3).tolist())
    out = np.zeros(ids.shape + (3,), np.int32)
    for b in range(ids.shape[0]):
        keep = np.flatnonzero(mask[b])
        kind = kinds[b, keep]
        pos, cur, i = [], 0, 0
        while i < len(kind):
            j = i
            while j < len(kind) and kind[j] == kind[i]:
                j += 1
            if kind[i] == 0:
                pos.append(np.repeat(np.arange(cur, cur + j - i)[:, None], 3, 1))
                cur += j - i
            elif kind[i] == 1:
                t, h, w = next(grids)
                if t != 1:
                    raise ValueError(f"image_grid_thw: t={t}; images have t=1 (videos are "
                                     f"not supported by mmjax's Qwen2-VL)")
                if (j - i) != (h // merge) * (w // merge):
                    raise ValueError(f"row {b}: {j - i} image tokens but image_grid_thw "
                                     f"({t}, {h}, {w}) gives {(h // merge) * (w // merge)}")
                pos.append(vision_token_positions(cur, h // merge, w // merge))
                cur += max(h, w) // merge
            else:
                raise ValueError("mm_token_type_ids: video tokens (2) are not supported by "
                                 "mmjax's Qwen2-VL; images (1) and text (0) only")
            i = j
        if pos:
            out[b, keep] = np.concatenate(pos)
    return out
