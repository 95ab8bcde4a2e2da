"""Backward of the block-sparse bitfield-mask flash attention as two Pallas kernels.

FlashAttention-2's backward (Dao 2023, Algorithm 2) split the way its Triton kernels split it,
so no program writes another's output:

- `dkv`: one program per (key block, batch row, query head). It loops over the query blocks
  that hold an allowed pair with its key block (the forward's tile map transposed, compacted
  the same way: `attention_pallas.block_lists`), recomputes each tile's probabilities from the
  saved log-sum-exp and accumulates dK and dV of its key block for that query head. The GQA
  sum over the query heads of a key/value head is one XLA reduction afterwards.
- `dq`: one program per (query block, batch row, query head), looping over the forward's key
  block list, accumulating dQ.

Each tile's mask is built in registers from the token metadata (Cornstarch §4.3.1), as in the
forward kernel, and empty tiles are never visited: backward work is the non-empty tile count,
like the forward's. `delta` (rowsum(dO * O)) is computed once in XLA and read by both. The
queries' window floor is a fifth query-metadata array; soft-capped logits multiply dS by the
tanh's derivative, 1 - (s / softcap)^2.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mmjax.models.attention_mask import TokenMeta, allowed_mask, cap_logits

_F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))  # a @ b.T
_NN = (((1,), (0,)), ((), ()))  # a @ b
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _probs(q, k, lse, mask, scale, softcap):
    """Softmax probabilities of one tile, recomputed from the log-sum-exp (0 where masked;
    `mask` None on an all-allowed tile), and the factor dS picks up from soft-capping (1
    without it)."""
    s = cap_logits(lax.dot_general(q, k, _NT, preferred_element_type=_F32) * scale, softcap)
    dcap = 1.0 if softcap is None else 1.0 - jnp.square(s / softcap)
    p = jnp.exp(s - lse[:, None])
    return (p if mask is None else jnp.where(mask, p, 0.0)), dcap


def _dkv_kernel(list_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref,
                qb_ref, qd_ref, qs_ref, qi_ref, qf_ref, kb_ref, kd_ref, ks_ref, ki_ref,
                dk_ref, dv_ref, *, scale, bq, softcap):
    k, v = k_ref[...], v_ref[...]
    k_meta = (kb_ref[...], kd_ref[...], ks_ref[...], ki_ref[...])

    def body(t, carry, masked: bool):
        dk, dv = carry
        sl = pl.ds(list_ref[t + 2] * bq, bq)
        q, do = q_ref[sl, :], do_ref[sl, :]
        mask = None if not masked else allowed_mask(
            qb_ref[sl], k_meta[0], qi_ref[sl], k_meta[3],
            qd_ref[sl], k_meta[1], qs_ref[sl], k_meta[2], qf_ref[sl])
        p, dcap = _probs(q, k, lse_ref[sl], mask, scale, softcap)       # [bq, bk]
        dv = dv + lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=_F32)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=_F32)    # [bq, bk]
        ds = p * (dp - delta_ref[sl][:, None]) * scale * dcap
        dk = dk + lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=_F32)
        return dk, dv

    zeros = jnp.zeros(k.shape, _F32)
    carry = lax.fori_loop(0, list_ref[1], partial(body, masked=True), (zeros, zeros))
    dk, dv = lax.fori_loop(list_ref[1], list_ref[0], partial(body, masked=False), carry)
    dk_ref[...] = dk
    dv_ref[...] = dv


def _dq_kernel(list_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref,
               qb_ref, qd_ref, qs_ref, qi_ref, qf_ref, kb_ref, kd_ref, ks_ref, ki_ref,
               dq_ref, *, scale, bk, softcap):
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_meta = (qb_ref[...], qd_ref[...], qs_ref[...], qi_ref[...], qf_ref[...])

    def body(t, dq, masked: bool):
        sl = pl.ds(list_ref[t + 2] * bk, bk)
        k, v = k_ref[sl, :], v_ref[sl, :]
        mask = None if not masked else allowed_mask(
            q_meta[0], kb_ref[sl], q_meta[3], ki_ref[sl],
            q_meta[1], kd_ref[sl], q_meta[2], ks_ref[sl], q_meta[4])
        p, dcap = _probs(q, k, lse, mask, scale, softcap)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=_F32)
        ds = p * (dp - delta[:, None]) * scale * dcap
        return dq + lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=_F32)

    dq = lax.fori_loop(0, list_ref[1], partial(body, masked=True), jnp.zeros(q.shape, _F32))
    dq = lax.fori_loop(list_ref[1], list_ref[0], partial(body, masked=False), dq)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def triton_params(warps: tuple[int | None, int | None]) -> dict:
    """`pallas_call` keyword for Triton's (num_warps, num_stages); none in interpret mode or
    when both are None (Triton's defaults)."""
    if jax.default_backend() != "gpu" or warps == (None, None):
        return {}
    from jax.experimental.pallas import triton as pl_triton

    return {"compiler_params": pl_triton.CompilerParams(num_warps=warps[0], num_stages=warps[1])}


def pallas_backward(q, k, v, mq: TokenMeta, mk: TokenMeta, fq, out, lse, dout,
                    q_lists, k_lists, bq: int, bk: int, scale: float,
                    softcap: float | None = None,
                    warps: tuple[int | None, int | None] = (None, None)):
    """(dq, dk, dv) of block-aligned inputs. `lse` f32 [B, H, Sq] from the forward kernel;
    `q_lists` [B, nq, W]: per query block its non-empty key blocks (the forward's list);
    `k_lists` [B, nk, W']: per key block its non-empty query blocks; `scale` the logits'
    (1 / sqrt of the model's head dim, which zero padding may have widened); `fq` [B, Sq]
    the queries' window floor; `softcap` the forward's logit cap."""
    b, sq, h, d = q.shape
    sk, kv = k.shape[1], k.shape[2]
    g = h // kv
    interpret = jax.default_backend() != "gpu"
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1).transpose(0, 2, 1)

    # dK, dV: grid over key blocks; the whole query side of (row, head) is visible.
    kblk = pl.BlockSpec((None, bk, None, d), lambda i, r, j: (r, i, j // g, 0))
    qall = pl.BlockSpec((None, sq, None, d), lambda i, r, j: (r, 0, j, 0))
    rows = pl.BlockSpec((None, None, sq), lambda i, r, j: (r, j, 0))
    mq_all = pl.BlockSpec((None, sq), lambda i, r, j: (r, 0))
    mk_blk = pl.BlockSpec((None, bk), lambda i, r, j: (r, i))
    per_head = pl.BlockSpec((None, bk, None, d), lambda i, r, j: (r, i, j, 0))
    wk = k_lists.shape[-1]
    dk_h, dv_h = pl.pallas_call(
        partial(_dkv_kernel, scale=scale, bq=bq, softcap=softcap), grid=(sk // bk, b, h),
        in_specs=[pl.BlockSpec((None, None, wk), lambda i, r, j: (r, i, 0)),
                  kblk, kblk, qall, qall, rows, rows, *([mq_all] * 5), *([mk_blk] * 4)],
        out_specs=[per_head, per_head],
        out_shape=[jax.ShapeDtypeStruct((b, sk, h, d), _F32)] * 2,
        interpret=interpret, name="bam_flash_backward_dkv", **triton_params(warps),
    )(k_lists, k, v, q, dout, lse, delta, *mq, fq, *mk)
    fold = lambda x: x.reshape(b, sk, kv, g, d).sum(3)  # GQA: sum the group's query heads

    # dQ: grid over query blocks, as the forward.
    qblk = pl.BlockSpec((None, bq, None, d), lambda i, r, j: (r, i, j, 0))
    kall = pl.BlockSpec((None, sk, None, d), lambda i, r, j: (r, 0, j // g, 0))
    row_blk = pl.BlockSpec((None, None, bq), lambda i, r, j: (r, j, i))
    mq_blk = pl.BlockSpec((None, bq), lambda i, r, j: (r, i))
    mk_all = pl.BlockSpec((None, sk), lambda i, r, j: (r, 0))
    wq = q_lists.shape[-1]
    dq = pl.pallas_call(
        partial(_dq_kernel, scale=scale, bk=bk, softcap=softcap), grid=(sq // bq, b, h),
        in_specs=[pl.BlockSpec((None, None, wq), lambda i, r, j: (r, i, 0)),
                  qblk, qblk, row_blk, row_blk, kall, kall, *([mq_blk] * 5), *([mk_all] * 4)],
        out_specs=qblk, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret, name="bam_flash_backward_dq", **triton_params(warps),
    )(q_lists, q, dout, lse, delta, k, v, *mq, fq, *mk)
    return dq, fold(dk_h).astype(k.dtype), fold(dv_h).astype(v.dtype)
