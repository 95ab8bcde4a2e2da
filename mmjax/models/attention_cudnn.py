"""cuDNN fused attention for the plain causal and full mask families (GPU only).

`bam_attention(..., mask_family="causal")` promises one causal document per row with its real
tokens first (doc != 0) and padding after: exactly cuDNN's PADDING_CAUSAL mask given per-row
lengths; `mask_family="full"` the same without causality (cuDNN's PADDING mask). jax's public API has no segment ids, so packed or multimodal masks never come here
(`models/attention.py: choose_implementation` rejects them with a one-line error). A static
sliding window on the causal family is cuDNN's left window (`local_window_size=(w - 1, 0)`:
idx_q - idx_k < w); a window that varies per layer inside a scan, or soft-capping, never
comes here (`attention.cudnn_options_error`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mmjax.models.attention_mask import TokenMeta


def cudnn_attention(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta, causal: bool = True,
                    window: int | None = None, scale: float | None = None):
    """q [B,Sq,H,D], k/v [B,Sk,KV,D] under (causal) attention over each row's real tokens;
    `window`: a static sliding window (causal only); `scale`: logit scale (D ** -0.5)."""
    q_len = jnp.sum(meta_q.doc != 0, axis=1, dtype=jnp.int32)
    k_len = jnp.sum(meta_k.doc != 0, axis=1, dtype=jnp.int32)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, query_seq_lengths=q_len,
                                       key_value_seq_lengths=k_len, scale=scale,
                                       local_window_size=None if window is None else
                                       (int(window) - 1, 0), implementation="cudnn")
    real = (meta_q.doc != 0)[:, :, None, None]
    return jnp.where(real, out, jnp.zeros_like(out))
