"""Attention with segment ids and Cornstarch bitfield attention masks (Cornstarch §4.3.1).

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

from functools import partial

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


def f32_einsum(spec: str, a, b):
    """einsum with a float32 result (attention logits, LM-head logits).

    Low-precision (bf16) operands keep the float32 forward, and the backward casts the float32
    cotangent down to the operands' dtype first, so the backward matmuls run on bf16 operands
    too instead of mixed float32 x bf16 dots (mixed-precision training keeps gradients of
    activations in the compute dtype). float32 operands take the plain path, unchanged.
    """
    if a.dtype == jnp.float32 and b.dtype == jnp.float32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _lowp_einsum(spec, a, b)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _lowp_einsum(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _lowp_einsum_fwd(spec, a, b):
    return _lowp_einsum(spec, a, b), (a, b)


def _lowp_einsum_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda x, y: jnp.einsum(spec, x, y), a, b)
    return vjp(g.astype(jnp.result_type(a, b)))


_lowp_einsum.defvjp(_lowp_einsum_fwd, _lowp_einsum_bwd)


def dot_product_attention(q, k, v, allowed):
    """Masked softmax attention with grouped-query heads.

    q: [B, Sq, H, D]; k, v: [B, Sk, KV, D] with H a multiple of KV; allowed: bool broadcastable
    to [B, Sq, Sk]. Softmax runs in float32; a query with no allowed key outputs zeros.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    qg = q.reshape(b, sq, kv, h // kv, d)
    logits = f32_einsum("bqkgd,bskd->bkgqs", qg, k) / jnp.sqrt(d).astype(jnp.float32)
    mask = allowed[:, None, None, :, :]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(mask, probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v)
    return out.reshape(b, sq, h, d)
