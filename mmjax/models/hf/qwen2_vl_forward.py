"""transformers' Qwen2-VL / Qwen2.5-VL forward on an mmjax `MultimodalModel` (`hf_forward`,
`hf.generate`): its inputs (input_ids, pixel_values, image_grid_thw, attention_mask,
mm_token_type_ids) turned into the model's arrays, and the logits."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.hf.qwen2_vl import _TOKENS
from mmjax.models.llm import mask_attend, merge_modalities
from mmjax.models.mllm import encode
from mmjax.models.qwen2_vl_config import mrope_positions, patch_positions


def qwen2_vl_embed(model, tokens, patches, patch_seg, patch_pos, gather):
    """The LLM's input embeddings: merged image features scattered at the image tokens."""
    spec = model.cfg.encoder("vision")
    feats = encode(spec, model.encoders["vision"], model.projectors["vision"],
                   {"patches": patches, "patch_seg": patch_seg, "patch_pos": patch_pos})
    return merge_modalities(model.llm.embed_tokens(tokens), {"vision": feats},
                            {"vision": gather})


@nnx.jit
def _logits(model, tokens, positions, allowed, patches, patch_seg, patch_pos, gather):
    x = qwen2_vl_embed(model, tokens, patches, patch_seg, patch_pos, gather)
    h = model.llm.run_layers(x, positions, mask_attend(allowed))
    return model.llm.logits(model.llm.final_hidden(h))


def image_token_id(model) -> int:
    source = json.loads(getattr(model, "hf_source", "null") or "null")
    return int((source["config"] if source else _TOKENS).get("image_token_id",
                                                             _TOKENS["image_token_id"]))


def qwen2_vl_prompt(model, input_ids, pixel_values=None, image_grid_thw=None,
                    attention_mask=None, mm_token_type_ids=None) -> dict:
    """transformers' Qwen2-VL inputs -> the arrays `qwen2_vl_embed` takes (tokens, patches,
    patch_seg, patch_pos, gather) and the M-RoPE `positions` of `get_rope_index`."""
    ids = np.asarray(input_ids)
    vis = model.cfg.encoder("vision").encoder
    m = vis.spatial_merge_size
    image_id = image_token_id(model)
    mm = (ids == image_id).astype(np.int32) if mm_token_type_ids is None else \
        np.asarray(mm_token_type_ids)
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else \
        np.asarray(image_grid_thw).reshape(-1, 3)
    positions = mrope_positions(ids, mm, grids, m, attention_mask)
    seg_parts, pos_parts = [np.zeros(0, np.int32)], [np.zeros((0, 2), np.int32)]
    for i, (t, h, w) in enumerate(grids.tolist()):
        if t != 1:
            raise ValueError(f"image_grid_thw[{i}] has t={t}: mmjax's Qwen2-VL takes images "
                             f"(t=1), not videos")
        seg_parts.append(np.full(h * w, i + 1, np.int32))
        pos_parts.append(patch_positions(h, w, m))
    seg, pos = np.concatenate(seg_parts), np.concatenate(pos_parts)
    n = len(seg)
    pixels = np.zeros((max(n, 4), vis.patch_dim), np.float32)
    if n:
        pv = np.asarray(pixel_values, np.float32)
        if pv.shape != (n, vis.patch_dim):
            raise ValueError(f"pixel_values has shape {pv.shape}; image_grid_thw gives "
                             f"({n}, {vis.patch_dim})")
        pixels[:n] = pv
    pad = max(n, 4) - n
    seg, pos = np.pad(seg, (0, pad)), np.pad(pos, ((0, pad), (0, 0)))
    is_image = ids == image_id
    if is_image.sum() != n // (m * m):
        raise ValueError(f"{is_image.sum()} image tokens in input_ids but image_grid_thw "
                         f"gives {n // (m * m)}")
    gather = np.full(ids.shape, -1, np.int32)
    gather[is_image] = np.arange(is_image.sum())
    return {"tokens": jnp.asarray(ids, jnp.int32), "patches": jnp.asarray(pixels)[None],
            "patch_seg": jnp.asarray(seg)[None], "patch_pos": jnp.asarray(pos)[None],
            "gather": jnp.asarray(gather), "positions": jnp.asarray(positions)}


def qwen2_vl_forward(model, input_ids, pixel_values=None, image_grid_thw=None,
                     attention_mask=None, mm_token_type_ids=None) -> dict:
    """transformers' Qwen2-VL forward (images and text): M-RoPE positions from
    `get_rope_index`, images packed into one buffer (attention per image / window), merged
    features scattered at the image tokens, causal attention (+ attention_mask)."""
    a = qwen2_vl_prompt(model, input_ids, pixel_values, image_grid_thw, attention_mask,
                        mm_token_type_ids)
    b, s = np.shape(input_ids)
    allowed = np.tril(np.ones((s, s), bool))[None].repeat(b, 0)
    if attention_mask is not None:
        allowed &= (np.asarray(attention_mask) != 0)[:, None, :]
    logits = _logits(model, a["tokens"], a["positions"], jnp.asarray(allowed), a["patches"],
                     a["patch_seg"], a["patch_pos"], a["gather"])
    return {"logits": logits}
