"""Chunked bitfield-mask attention: blockwise online softmax in pure XLA (flash-attention 2).

Queries and keys are cut into blocks of `block_q` / `block_k` tokens. The forward pass maps
over query blocks and scans over key blocks, keeping per row the running maximum, the running
softmax denominator and the unnormalised output (Dao, FlashAttention-2 Algorithm 1); the mask
of each (query block, key block) tile is built from the token metadata inside the loop, and a
tile with no allowed pair is skipped (`lax.cond`). It saves only the output and the per-row
log-sum-exp; the custom VJP recomputes each tile's probabilities in the backward pass
(FlashAttention-2 Algorithm 2: key blocks outer, query blocks inner, dQ accumulated across
key blocks). Memory is O(S * block), there is no [S, S] array in forward or backward.

Lengths that are not a multiple of the block are padded internally with doc-0 tokens (they
attend nothing and nothing attends them) and cut off again. A sliding window enters as each
query's lowest allowed key index (`attention.window_floor`), so tiles outside it are empty
and skipped; soft-capped logits (Gemma 2) are differentiated through the tanh in the
backward pass.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from mmjax.models.attention_mask import TokenMeta, cap_logits, meta_mask, window_floor

BLOCK_Q = 128
BLOCK_K = 128
_F32 = jnp.float32


def _pad_seq(x, length: int):
    """Zero-pad axis 1 of x to `length`."""
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def block_shape(seq_len: int, block: int) -> tuple[int, int]:
    """(block size, number of blocks) for a sequence: the block shrinks to short sequences."""
    b = max(1, min(block, seq_len))
    return b, -(-seq_len // b)


def chunked_attention(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta, *,
                      block_q: int = BLOCK_Q, block_k: int = BLOCK_K, window=None,
                      softcap: float | None = None, scale: float | None = None):
    """`bam_attention` semantics (q [B,Sq,H,D], k/v [B,Sk,KV,D]) in O(S * block) memory;
    `window` / `softcap` / `scale`: `attention.AttnOptions`."""
    sq, sk = q.shape[1], k.shape[1]
    bq, nq = block_shape(sq, block_q)
    bk, nk = block_shape(sk, block_k)
    qp = _pad_seq(q, nq * bq)
    kp, vp = _pad_seq(k, nk * bk), _pad_seq(v, nk * bk)
    mq = TokenMeta(*(_pad_seq(a, nq * bq) for a in meta_q))
    mk = TokenMeta(*(_pad_seq(a, nk * bk) for a in meta_k))
    floor = _pad_seq(window_floor(meta_q, window), nq * bq)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    return flash_attention(qp, kp, vp, mq, mk, floor, bq, bk, scale, softcap)[:, :sq]


def _meta_blocks(meta: TokenMeta, blk: int) -> TokenMeta:
    """TokenMeta [B, n*blk] -> TokenMeta [n, B, blk]."""
    return TokenMeta(*(a.reshape(a.shape[0], -1, blk).transpose(1, 0, 2) for a in meta))


def _split_q(x, bq, kv):
    """[B, Sq, H, D] -> [nq, B, KV, G, bq, D] (head h = kv * G + g, as in the dense path)."""
    b, s, h, d = x.shape
    return x.reshape(b, s // bq, bq, kv, h // kv, d).transpose(1, 0, 3, 4, 2, 5)


def _merge_q(x):
    """[nq, B, KV, G, bq, D] -> [B, Sq, H, D]."""
    nq, b, kv, g, bq, d = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv * g, d)


def _split_k(x, bk):
    """[B, Sk, KV, D] -> [nk, B, KV, bk, D]."""
    b, s, kv, d = x.shape
    return x.reshape(b, s // bk, bk, kv, d).transpose(1, 0, 3, 2, 4)


def _merge_k(x):
    nk, b, kv, bk, d = x.shape
    return x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, kv, d)


def _split_rows(x, bq, kv):
    """Per-row [B, Sq, H] -> [nq, B, KV, G, bq]."""
    b, s, h = x.shape
    return x.reshape(b, s // bq, bq, kv, h // kv).transpose(1, 0, 3, 4, 2)


def _zero_like_all(*trees):
    """A float32 zero that varies over every mesh axis any input varies over (inside
    shard_map), so loop carries started from it type-check against the tile updates."""
    z = jnp.zeros((), _F32)
    for leaf in jax.tree.leaves(trees):
        z = z + jnp.sum(leaf[..., :0]).astype(_F32)
    return z


def _logits(qi, ki, scale, softcap):
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, ki, preferred_element_type=_F32) * scale
    return cap_logits(s, softcap)


def _tile_mask(mqi: TokenMeta, mki: TokenMeta, fqi):
    return meta_mask(mqi, mki, fqi)[:, None, None]  # [B, 1, 1, bq, bk]


def _forward_block(qi, mqi, fqi, kb, vb, mkb, scale, softcap):
    """One query block against every key block: (out [B,KV,G,bq,D] f32, lse [B,KV,G,bq])."""
    b, kv, g, bq, d = qi.shape
    z = _zero_like_all(qi, mqi, kb, vb, mkb)

    def step(carry, xs):
        ki, vi, mki = xs
        mask = _tile_mask(mqi, mki, fqi)

        def visit(carry):
            m, l, acc = carry
            s = jnp.where(mask, _logits(qi, ki, scale, softcap), -jnp.inf)
            m_new = jnp.maximum(m, s.max(-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vi.dtype), vi,
                            preferred_element_type=_F32)
            return m_new, alpha * l + p.sum(-1), alpha[..., None] * acc + pv

        return lax.cond(jnp.any(mask), visit, lambda c: c, carry), None

    init = (jnp.full((b, kv, g, bq), -jnp.inf, _F32) + z, jnp.zeros((b, kv, g, bq), _F32) + z,
            jnp.zeros((b, kv, g, bq, d), _F32) + z)
    (m, l, acc), _ = lax.scan(step, init, (kb, vb, mkb))
    seen = l > 0
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out, lse


def _blocks(x, blk):
    """[B, n*blk] -> [n, B, blk]."""
    return x.reshape(x.shape[0], -1, blk).transpose(1, 0, 2)


def _forward(q, k, v, mq, mk, fq, bq, bk, scale, softcap):
    kv = k.shape[2]
    kb, vb, mkb = _split_k(k, bk), _split_k(v, bk), _meta_blocks(mk, bk)
    out, lse = lax.map(
        lambda xs: _forward_block(xs[0], xs[1], xs[2], kb, vb, mkb, scale, softcap),
        (_split_q(q, bq, kv), _meta_blocks(mq, bq), _blocks(fq, bq)))
    return _merge_q(out).astype(q.dtype), lse  # lse [nq, B, KV, G, bq]


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def flash_attention(q, k, v, mq: TokenMeta, mk: TokenMeta, fq, bq: int, bk: int,
                    scale: float, softcap: float | None = None):
    """Blockwise attention on block-aligned inputs (Sq = nq*bq, Sk = nk*bk); `fq` [B, Sq]
    each query's lowest allowed key index (`attention.window_floor`)."""
    return _forward(q, k, v, mq, mk, fq, bq, bk, scale, softcap)[0]


def _flash_fwd(q, k, v, mq, mk, fq, bq, bk, scale, softcap):
    out, lse = _forward(q, k, v, mq, mk, fq, bq, bk, scale, softcap)
    return out, (q, k, v, mq, mk, fq, out, lse)


def flash_backward(q, k, v, mq, mk, fq, out, lse, dout, bq, bk, scale, softcap=None):
    """FlashAttention-2 backward: (dq, dk, dv) recomputing each non-empty tile once."""
    kv = k.shape[2]
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)  # [B, Sq, H]
    qb, dob = _split_q(q, bq, kv), _split_q(dout, bq, kv)
    lseb, deltab, mqb = lse, _split_rows(delta, bq, kv), _meta_blocks(mq, bq)
    fqb = _blocks(fq, bq)
    z = _zero_like_all(q, k, v, mq, mk, out, lse, dout)

    def key_block(dq_all, xs):
        ki, vi, mki = xs

        def query_block(carry, ys):
            qi, doi, lsei, di, mqi, fqi, dqi = ys
            mask = _tile_mask(mqi, mki, fqi)

            def visit(args):
                dk, dv, dqi = args
                s = _logits(qi, ki, scale, softcap)
                p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p.astype(doi.dtype), doi,
                                     preferred_element_type=_F32)
                dp = jnp.einsum("bkgqd,bksd->bkgqs", doi, vi, preferred_element_type=_F32)
                ds = p * (dp - di[..., None]) * scale
                if softcap is not None:  # d(c tanh(x / c)) / dx = 1 - tanh^2
                    ds = ds * (1.0 - jnp.square(s / softcap))
                dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds.astype(qi.dtype), qi,
                                     preferred_element_type=_F32)
                dqi = dqi + jnp.einsum("bkgqs,bksd->bkgqd", ds.astype(ki.dtype), ki,
                                       preferred_element_type=_F32)
                return dk, dv, dqi

            dk, dv, dqi = lax.cond(jnp.any(mask), visit, lambda a: a, (*carry, dqi))
            return (dk, dv), dqi

        zeros = jnp.zeros(ki.shape, _F32) + z
        (dk, dv), dq_all = lax.scan(query_block, (zeros, zeros),
                                    (qb, dob, lseb, deltab, mqb, fqb, dq_all))
        return dq_all, (dk, dv)

    dq0 = jnp.zeros(qb.shape, _F32) + z
    dq, (dk, dv) = lax.scan(key_block, dq0, (_split_k(k, bk), _split_k(v, bk),
                                             _meta_blocks(mk, bk)))
    return _merge_q(dq).astype(q.dtype), _merge_k(dk).astype(k.dtype), _merge_k(dv).astype(v.dtype)


def _flash_bwd(bq, bk, scale, softcap, res, dout):
    q, k, v, mq, mk, fq, out, lse = res
    dq, dk, dv = flash_backward(q, k, v, mq, mk, fq, out, lse, dout, bq, bk, scale, softcap)
    return dq, dk, dv, None, None, None


flash_attention.defvjp(_flash_fwd, _flash_bwd)
