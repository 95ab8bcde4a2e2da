"""Block-sparse bitfield-mask flash attention as a Pallas kernel (Cornstarch §4.3.1).

The forward kernel runs one program per (query block, batch row, query head). It never sees
a mask: it reads the tokens' metadata (bam, doc, sub, idx) and builds each tile's mask in
registers with the BAM rule (`models/attention.py: allowed_mask`). Which key blocks it visits
comes from a block map computed from the metadata before the kernel: per (row, query block)
the compacted list of key blocks holding at least one allowed pair, its length first
(`block_lists`). The kernel loops over that list only, so empty tiles cost nothing; the work
of a query block is its count of non-empty tiles, the quantity Cornstarch's LPT token
distribution balances (§4.3.2). With `debug=True` the kernel also writes how many tiles each
program visited (`visited_tiles`).

Backward: two Pallas kernels (`attention_pallas_bwd.py`, FlashAttention-2's backward split as
its Triton kernels split it) recompute each non-empty tile's probabilities from the saved
log-sum-exp; they walk the same block map (transposed for dK/dV), so the backward's work is
the non-empty tile count too.

On GPU the kernel lowers through Triton; elsewhere it runs with `interpret=True` (slow, for
tests). Triton takes only tiles whose sizes are powers of two: block sizes are, lengths that
are not a multiple of the block are padded with doc-0 tokens (as in the chunked path), and a
head dim that is not (SigLIP's 72) is zero-padded (zeros add nothing to q . k, the extra
output columns are dropped; the scale stays the model's).

Sliding windows (Mistral, Gemma's local layers) enter as a fifth per-query array, each query's
lowest allowed key index (`attention.window_floor`): the block map is built with it, so tiles
wholly outside the window are never visited (`visited_tiles` counts them), and the kernel's
in-register mask applies it inside the boundary tiles. The window may be traced (one per
layer inside a layer scan). Gemma 2's logit soft-capping is applied in the kernels (and
differentiated through the tanh in the backward kernels).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mmjax.models.attention_mask import (TokenMeta, allowed_mask, cap_logits, meta_mask,
                                         window_floor)
from mmjax.models.attention_chunked import _pad_seq
from mmjax.models.attention_pallas_bwd import pallas_backward, triton_params

BLOCK_Q = 128
BLOCK_K = 32  # = data/token_distribution.py DEFAULT_KEY_BLOCK (Cornstarch: 128 x 32 tiles)
# the tile compiled for a GPU (scripts/bench_pallas_tiles.py's sweep on an H100: 64 x 64 is
# the fastest tile Triton compiles there; 128 x 128 runs out of shared memory)
GPU_BLOCKS = (64, 64)


def default_blocks() -> tuple[int, int]:
    """(block_q, block_k) when the caller names none: the GPU's tuned tile, else Cornstarch's
    128 x 32 (the tile the CP work model counts; interpret mode on CPU)."""
    return GPU_BLOCKS if jax.default_backend() == "gpu" else (BLOCK_Q, BLOCK_K)
_F32 = jnp.float32
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "-inf": no inf - inf inside the tile


def _pow2_block(seq_len: int, block: int) -> tuple[int, int]:
    """(block, num blocks): a power of two no larger than needed."""
    b = min(block, pl.next_power_of_2(seq_len))
    return b, -(-seq_len // b)


def tile_classes(meta_q: TokenMeta, meta_k: TokenMeta, bq: int, bk: int, floor_q=None):
    """(any, full) bool [B, nq, nk]: does tile (query block, key block) hold an allowed pair,
    and are all its pairs allowed (the kernels then skip the mask: on a causal mask every
    tile below the diagonal)?

    One query block at a time (`lax.map`), so memory is O(bq * Sk), never [Sq, Sk]. Inputs are
    block-aligned (padded) metadata; `floor_q` [B, Sq]: the queries' `window_floor`."""
    b, sq = meta_q.doc.shape
    nq, nk = sq // bq, meta_k.doc.shape[1] // bk
    floor_q = window_floor(meta_q) if floor_q is None else floor_q

    def one(xs):
        mqi, fqi = xs
        m = meta_mask(TokenMeta(*mqi), meta_k, fqi).reshape(b, bq, nk, bk)  # [B, bq, Sk]
        return m.any(axis=(1, 3)), m.all(axis=(1, 3))

    split = lambda a: a.reshape(b, nq, bq).transpose(1, 0, 2)
    blocks = TokenMeta(*(split(a) for a in meta_q))
    anyt, full = lax.map(one, (blocks, split(floor_q)))
    return anyt.transpose(1, 0, 2), full.transpose(1, 0, 2)


def tile_map(meta_q: TokenMeta, meta_k: TokenMeta, bq: int, bk: int, floor_q=None):
    """bool [B, nq, nk]: does tile (query block, key block) hold an allowed pair?"""
    return tile_classes(meta_q, meta_k, bq, bk, floor_q)[0]


def block_lists(tiles, full=None):
    """[B, nq, nk] bool (`full`: the tiles whose pairs are all allowed) -> int32 [B, nq, W]:
    entry 0 the count of non-empty key blocks, entry 1 how many of them need the mask, then
    their indices, masked ones first, each group in increasing order (W a power of two
    >= nk + 2; the tail is unused)."""
    nk = tiles.shape[-1]
    width = pl.next_power_of_2(nk + 2)
    full = jnp.zeros_like(tiles) if full is None else full & tiles
    rank = jnp.where(tiles, jnp.where(full, 1, 0), 2)  # masked, then full, then empty
    order = jnp.argsort(rank, axis=-1, stable=True).astype(jnp.int32)
    count = tiles.sum(-1, dtype=jnp.int32)[..., None]
    masked = (tiles & ~full).sum(-1, dtype=jnp.int32)[..., None]
    pad = jnp.zeros(tiles.shape[:-1] + (width - nk - 2,), jnp.int32)
    return jnp.concatenate([count, masked, order, pad], axis=-1)


def _kernel(list_ref, q_ref, k_ref, v_ref, qb_ref, qd_ref, qs_ref, qi_ref, qf_ref,
            kb_ref, kd_ref, ks_ref, ki_ref, o_ref, lse_ref, *visit_ref, scale, bk, softcap):
    q = q_ref[...]
    bq = q.shape[0]
    q_meta = (qb_ref[...], qd_ref[...], qs_ref[...], qi_ref[...], qf_ref[...])
    count = list_ref[0]

    def tile(t, carry, masked: bool):
        o, m, l = carry
        sl = pl.ds(list_ref[t + 2] * bk, bk)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = cap_logits(lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                       preferred_element_type=_F32) * scale, softcap)
        if masked:
            mask = allowed_mask(q_meta[0], kb_ref[sl], q_meta[3], ki_ref[sl],
                                q_meta[1], kd_ref[sl], q_meta[2], ks_ref[sl], q_meta[4])
            s = jnp.where(mask, s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m - m_new)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             preferred_element_type=_F32)
        return alpha[:, None] * o + pv, m_new, alpha * l + p.sum(axis=-1)

    init = (jnp.zeros(q.shape, _F32), jnp.full((bq,), _NEG, _F32), jnp.zeros((bq,), _F32))
    # tiles that need the mask (the diagonal, document edges), then the all-allowed ones
    carry = lax.fori_loop(0, list_ref[1], partial(tile, masked=True), init)
    o, m, l = lax.fori_loop(list_ref[1], count, partial(tile, masked=False), carry)
    seen = l > 0
    safe_l = jnp.where(seen, l, 1.0)
    o_ref[...] = jnp.where(seen[:, None], o / safe_l[:, None], 0.0).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log(safe_l), 0.0)
    if visit_ref:
        visit_ref[0][...] = jnp.full((bq,), count, jnp.int32)


def _pallas_forward(q, k, v, mq: TokenMeta, mk: TokenMeta, fq, lists, bq: int, bk: int,
                    scale: float, debug: bool, softcap: float | None = None,
                    warps: tuple[int | None, int | None] = (None, None)):
    """Block-aligned inputs (`fq` [B, Sq]: the queries' window floor) and the query blocks'
    key-block lists -> (out [B,Sq,H,D], lse [B,H,Sq] f32[, visits [B,H,Sq]])."""
    b, sq, h, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g, nq = h // kv, sq // bq
    width = lists.shape[-1]
    interpret = jax.default_backend() != "gpu"
    q_spec = pl.BlockSpec((None, bq, None, d), lambda i, r, j: (r, i, j, 0))
    k_spec = pl.BlockSpec((None, sk, None, d), lambda i, r, j: (r, 0, j // g, 0))
    mq_spec = pl.BlockSpec((None, bq), lambda i, r, j: (r, i))
    mk_spec = pl.BlockSpec((None, sk), lambda i, r, j: (r, 0))
    row_spec = pl.BlockSpec((None, None, bq), lambda i, r, j: (r, j, i))
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), _F32)]
    out_specs = [q_spec, row_spec]
    if debug:
        out_shape.append(jax.ShapeDtypeStruct((b, h, sq), jnp.int32))
        out_specs.append(row_spec)
    kernel = partial(_kernel, scale=scale, bk=bk, softcap=softcap)
    return pl.pallas_call(
        kernel, grid=(nq, b, h),
        in_specs=[pl.BlockSpec((None, None, width), lambda i, r, j: (r, i, 0)),
                  q_spec, k_spec, k_spec, *([mq_spec] * 5), *([mk_spec] * 4)],
        out_specs=out_specs, out_shape=out_shape, interpret=interpret,
        name="bam_flash_forward", **triton_params(warps),
    )(lists, q, k, v, *mq, fq, *mk)


def _pad_head(x, width: int):
    d = x.shape[-1]
    return x if d == width else jnp.pad(x, ((0, 0),) * (x.ndim - 1) + ((0, width - d),))


def _pad_meta(meta_q, meta_k, block_q, block_k, window=None):
    """Block-aligned metadata (tile sizes powers of two: Triton's rule) and the window as the
    queries' floor (padding gets floor 0: it attends nothing anyway) -> (mq, mk, fq, bq, bk)."""
    bq, nq = _pow2_block(meta_q.doc.shape[1], block_q)
    bk, nk = _pow2_block(meta_k.doc.shape[1], block_k)
    mq = TokenMeta(*(_pad_seq(a, nq * bq) for a in meta_q))
    mk = TokenMeta(*(_pad_seq(a, nk * bk) for a in meta_k))
    fq = _pad_seq(window_floor(TokenMeta(*meta_q), window), nq * bq)
    return mq, mk, fq, bq, bk


def _pad_inputs(q, k, v, meta_q, meta_k, block_q, block_k, window=None
                ) -> tuple[tuple[jax.Array, jax.Array, jax.Array, TokenMeta, TokenMeta, jax.Array],
                           int, int]:
    """`_pad_meta` and q, k, v padded to its lengths and a power-of-two head dim."""
    mq, mk, fq, bq, bk = _pad_meta(meta_q, meta_k, block_q, block_k, window)
    width = pl.next_power_of_2(q.shape[-1])
    qp = _pad_head(_pad_seq(q, mq.doc.shape[1]), width)
    kp, vp = (_pad_head(_pad_seq(x, mk.doc.shape[1]), width) for x in (k, v))
    return (qp, kp, vp, mq, mk, fq), bq, bk


class TileLists(NamedTuple):
    """The kernels' block lists for one (meta_q, meta_k) without a window, built once per step
    and shared by every layer (`tile_lists`): q_lists for the forward and dq, k_lists for dk /
    dv. Layers otherwise rebuild the same lists from the same metadata."""
    q_lists: jax.Array
    k_lists: jax.Array


def tile_lists(meta_q: TokenMeta, meta_k: TokenMeta | None = None, *,
               block_q: int | None = None, block_k: int | None = None) -> TileLists:
    meta_k = meta_q if meta_k is None else meta_k
    dq, dk = default_blocks()
    mq, mk, fq, bq, bk = _pad_meta(meta_q, meta_k, block_q or dq, block_k or dk)
    tiles, full = tile_classes(mq, mk, bq, bk, fq)
    return TileLists(block_lists(tiles, full),
                     block_lists(tiles.transpose(0, 2, 1), full.transpose(0, 2, 1)))


def pallas_attention(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta, *,
                     block_q: int | None = None, block_k: int | None = None, window=None,
                     softcap: float | None = None, scale: float | None = None,
                     warps: tuple[int | None, int | None] = (None, None),
                     tiles: TileLists | None = None):
    """`bam_attention` semantics with the block-sparse Pallas kernel; `window` / `softcap` /
    `scale`: `attention.AttnOptions`; `block_q` / `block_k` the tile, `warps` Triton's
    (num_warps, num_stages) for every kernel (None: Triton's default; the GPU tuning knobs
    `scripts/bench_pallas_tiles.py` sweeps; None: `default_blocks()`); `tiles`: this
    metadata's `tile_lists` at the same blocks, built once for all layers (used only
    without a window, which moves the lists per layer)."""
    dq, dk = default_blocks()
    block_q, block_k = block_q or dq, block_k or dk
    args, bq, bk = _pad_inputs(q, k, v, meta_q, meta_k, block_q, block_k, window)
    scale = float(q.shape[-1]) ** -0.5 if scale is None else float(scale)
    if tiles is None or window is not None:
        tiles = TileLists(*_lists(args[3], args[4], bq, bk, args[5]))
    out = _sparse_attention(*args, *tiles, bq, bk, scale, softcap, tuple(warps))
    return out[:, :q.shape[1], :, :q.shape[-1]]


def visited_tiles(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta, *,
                  block_q: int = BLOCK_Q, block_k: int = BLOCK_K, window=None):
    """Debug run of the kernel: int32 [B, H, nq], the key tiles each program visited."""
    args, bq, bk = _pad_inputs(q, k, v, meta_q, meta_k, block_q, block_k, window)
    lists = block_lists(tile_map(args[3], args[4], bq, bk, args[5]))
    visits = _pallas_forward(*args, lists, bq, bk, float(q.shape[-1]) ** -0.5, debug=True)[2]
    return visits[:, :, ::bq]


def _lists(mq, mk, bq, bk, fq):
    tiles, full = tile_classes(mq, mk, bq, bk, fq)
    return block_lists(tiles, full), block_lists(tiles.transpose(0, 2, 1), full.transpose(0, 2, 1))


@partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12))
def _sparse_attention(q, k, v, mq, mk, fq, q_lists, k_lists, bq, bk, scale, softcap, warps):
    return _pallas_forward(q, k, v, mq, mk, fq, q_lists, bq, bk, scale, False, softcap,
                           warps)[0]


def _sparse_fwd(q, k, v, mq, mk, fq, q_lists, k_lists, bq, bk, scale, softcap, warps):
    out, lse = _pallas_forward(q, k, v, mq, mk, fq, q_lists, bq, bk, scale, False, softcap,
                               warps)
    return out, (q, k, v, mq, mk, fq, out, lse, q_lists, k_lists)


def _sparse_bwd(bq, bk, scale, softcap, warps, res, dout):
    q, k, v, mq, mk, fq, out, lse, q_lists, k_lists = res
    dq, dk, dv = pallas_backward(q, k, v, mq, mk, fq, out, lse, dout, q_lists, k_lists, bq,
                                 bk, scale, softcap, warps)
    return dq, dk, dv, None, None, None, None, None


_sparse_attention.defvjp(_sparse_fwd, _sparse_bwd)
