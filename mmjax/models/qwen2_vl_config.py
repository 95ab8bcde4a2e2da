"""Qwen2-VL / Qwen2.5-VL settings checks and grid arithmetic (no JAX).

`VisionConfig(kind="qwen2_vl")` describes both towers; this module says which combinations
are Qwen2-VL's (LayerNorm blocks, plain MLP with quick_gelu, full attention per image) or
Qwen2.5-VL's (RMSNorm blocks, gated SiLU MLP, window attention except in
`fullatt_block_indexes`), and the M-RoPE frequency split an LLM may carry.
"""
from __future__ import annotations

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
