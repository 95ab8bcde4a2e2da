"""What a token may attend to: per-token `TokenMeta` and the Cornstarch bitfield-mask rule
(Cornstarch §4.3.1; the rule is spelt out in attention.py), the decoder options
(`AttnOptions`: window, soft-cap, scale) and the metadata of the common masks. Shared by the
dispatcher (attention.py) and every kernel (attention_chunked / _pallas / _pallas_bwd /
_cudnn), so the kernels import this and not the dispatcher that calls them.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# "bam": any bitfield mask; "causal": causal text with one document per row, its real tokens
# first; "full": every real token of a row sees every real key, real tokens first (the DiT's
# self- and cross-attention). Only "causal" and "full" may run on cuDNN: its public API takes
# per-row lengths, not segment ids.
MASK_FAMILIES = ("bam", "causal", "full")
# `window_floor` without a window: lower than any key index.
NO_FLOOR = -(1 << 30)


class AttnOptions(NamedTuple):
    """Per-call attention options a decoder layer passes its `attend` hook.

    window: None, a Python int, or a traced int32 scalar (a layer scan's per-layer window;
    >= 2**30 means none); softcap / scale: static floats or None (None: no capping,
    head_dim ** -0.5)."""

    window: object = None
    softcap: float | None = None
    scale: float | None = None


NO_OPTIONS = AttnOptions()


class TokenMeta(NamedTuple):
    """Per-token mask metadata, each int32 [B, S] (Cornstarch §4.3.1).

    bam: bitfield (bit 0 text, bit i+1 modality i); doc: packed document id (0 = padding);
    sub: modality-subsequence id (0 for text); idx: the token's *global* index in its row.
    """

    bam: jax.Array
    doc: jax.Array
    sub: jax.Array
    idx: jax.Array


def allowed_mask(bam_q, bam_k, idx_q, idx_k, doc_q, doc_k, sub_q, sub_k, floor_q=None):
    """Boolean [..., Sq, Sk] mask from per-token metadata of shape [..., Sq] and [..., Sk];
    `floor_q` [..., Sq]: each query's lowest allowed key index (a sliding window)."""
    q = lambda a: a[..., :, None]
    k = lambda a: a[..., None, :]
    same_doc = (q(doc_q) == k(doc_k)) & (q(doc_q) != 0)
    q_text = q(bam_q & 1) != 0
    text_rule = q_text & ((q(bam_q) & k(bam_k)) != 0) & (k(idx_k) <= q(idx_q))
    mod_rule = ~q_text & (q(sub_q) == k(sub_k)) & (q(sub_q) != 0)
    out = same_doc & (text_rule | mod_rule)
    return out if floor_q is None else out & (k(idx_k) >= q(floor_q))


def window_floor(meta_q: TokenMeta, window=None):
    """int32 [B, Sq]: the lowest key index each query may see, idx_q - window + 1 (HF's
    sliding window: idx_q - idx_k < window), or NO_FLOOR everywhere without a window."""
    if window is None:
        return jnp.full(meta_q.idx.shape, NO_FLOOR, jnp.int32)
    w = jnp.minimum(jnp.asarray(window, jnp.int32), -NO_FLOOR)
    return jnp.maximum(meta_q.idx - w + 1, NO_FLOOR).astype(jnp.int32)


def meta_mask(meta_q: TokenMeta, meta_k: TokenMeta, floor_q=None):
    """The bool [B, Sq, Sk] mask of two TokenMeta (and an optional `window_floor`)."""
    return allowed_mask(meta_q.bam, meta_k.bam, meta_q.idx, meta_k.idx,
                        meta_q.doc, meta_k.doc, meta_q.sub, meta_k.sub, floor_q)


def cap_logits(s, softcap: float | None):
    """Attention / final logit soft-capping (Gemma 2): softcap * tanh(s / softcap)."""
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _positions(segment_ids):
    return jnp.broadcast_to(jnp.arange(segment_ids.shape[-1], dtype=jnp.int32),
                            segment_ids.shape)


def causal_meta(segment_ids) -> TokenMeta:
    """Causal text inside packed documents ([B, S] ids, 0 = padding): `causal_segment_mask`."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    return TokenMeta((seg != 0).astype(jnp.int32), seg, jnp.zeros_like(seg), _positions(seg))


def segment_meta(segment_ids) -> TokenMeta:
    """Bidirectional attention inside segments ([B, S] ids, 0 = padding): `segment_mask`.
    Every token is a modality token (bit 1) whose subsequence is its segment."""
    seg = jnp.asarray(segment_ids, jnp.int32)
    return TokenMeta(jnp.where(seg != 0, 2, 0).astype(jnp.int32), seg, seg, _positions(seg))


def full_meta(batch: int, length: int) -> TokenMeta:
    """Every token sees every token (the generator's self- and cross-attention)."""
    return segment_meta(jnp.ones((batch, length), jnp.int32))


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
