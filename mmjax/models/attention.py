"""Attention with segment ids and Cornstarch bitfield attention masks (seed 002 §4.3.1).

A token carries `bam` (bit 0 = text, bit i+1 = modality i; 0 = padding), `doc` (packed
document id, 0 = padding), `sub` (modality-subsequence id, unique per image/clip in a row;
0 for text) and its global index in the row. The rule:

  allowed(q, k) = doc[q] == doc[k] != 0 and (
      text q:      (bam[q] & bam[k]) != 0 and k <= q          # causal over keys sharing a bit
      modality q:  sub[q] == sub[k] != 0 )                     # bidirectional inside its subsequence

Indices are global (not local to a context-parallel shard), so the same function builds the
mask for a CP rank's distributed queries against all-gathered keys.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def allowed_mask(bam_q, bam_k, idx_q, idx_k, doc_q, doc_k, sub_q, sub_k):
    """Boolean [..., Sq, Sk] mask from per-token metadata of shape [..., Sq] and [..., Sk]."""
    q = lambda a: a[..., :, None]
    k = lambda a: a[..., None, :]
    same_doc = (q(doc_q) == k(doc_k)) & (q(doc_q) != 0)
    q_text = q(bam_q & 1) != 0
    text_rule = q_text & ((q(bam_q) & k(bam_k)) != 0) & (k(idx_k) <= q(idx_q))
    mod_rule = ~q_text & (q(sub_q) == k(sub_k)) & (q(sub_q) != 0)
    return same_doc & (text_rule | mod_rule)


def causal_segment_mask(segment_ids):
    """Causal mask within packed documents: [B, S] segment ids -> [B, S, S]."""
    s = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(s), segment_ids.shape)
    text = jnp.where(segment_ids != 0, 1, 0)
    return allowed_mask(text, text, idx, idx, segment_ids, segment_ids,
                        jnp.zeros_like(segment_ids), jnp.zeros_like(segment_ids))


def segment_mask(segment_ids_q, segment_ids_k=None):
    """Bidirectional attention inside segments (ViT packing): [B, S] -> [B, S, S]."""
    segment_ids_k = segment_ids_q if segment_ids_k is None else segment_ids_k
    return ((segment_ids_q[..., :, None] == segment_ids_k[..., None, :])
            & (segment_ids_q[..., :, None] != 0))


def dot_product_attention(q, k, v, allowed):
    """Masked softmax attention with grouped-query heads.

    q: [B, Sq, H, D]; k, v: [B, Sk, KV, D] with H a multiple of KV; allowed: bool broadcastable
    to [B, Sq, Sk]. Softmax runs in float32; a query with no allowed key outputs zeros.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, sq, kv, h // kv, d)
    logits = jnp.einsum("bqkgd,bskd->bkgqs", qg, k,
                        preferred_element_type=jnp.float32) / jnp.sqrt(d).astype(jnp.float32)
    mask = allowed[:, None, None, :, :]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, sq, h, d)
