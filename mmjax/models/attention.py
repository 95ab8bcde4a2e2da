"""Attention with segment ids and Cornstarch bitfield attention masks (Cornstarch §4.3.1).

A token carries `bam` (bit 0 = text, bit i+1 = modality i; 0 = padding), `doc` (packed
document id, 0 = padding), `sub` (modality-subsequence id, unique per image/clip in a row;
0 for text) and its global index in the row. The rule:

  allowed(q, k) = doc[q] == doc[k] != 0 and (
      text q:      (bam[q] & bam[k]) != 0 and k <= q          # causal over keys sharing a bit
      modality q:  sub[q] == sub[k] != 0 )                     # bidirectional inside its subsequence

Indices are global (not local to a context-parallel shard), so the same function builds the
mask for a CP rank's distributed queries against all-gathered keys.

Every attention site calls `bam_attention(q, k, v, meta_q, meta_k, implementation=...)` with
per-token `TokenMeta` instead of a [B, Sq, Sk] mask, so an implementation can build the mask
tile by tile (Cornstarch §4.3.1: the bitfield mask is never materialised):

  dense    the whole [B, H, Sq, Sk] logits (the reference; `dot_product_attention`)
  chunked  blockwise online softmax in pure XLA, O(S * block) memory (attention_chunked.py)
  pallas   block-sparse flash attention that visits only non-empty tiles (attention_pallas.py)
  cudnn    cuDNN fused attention for plain causal or full masks on GPU (attention_cudnn.py)
  auto     the fastest valid one for the platform, the mask family and the length

Every implementation also takes the decoder families' options (`AttnOptions`): a sliding
`window` (a query sees keys with idx_q - idx_k < window, as HF's sliding_window masks; it
may be a traced per-layer value inside a layer scan), attention-logit soft-capping
`softcap` (Gemma 2: s -> softcap * tanh(s / softcap)) and the logit `scale` (Gemma's
query_pre_attn_scalar ** -0.5; default head_dim ** -0.5). Windows enter the mask as a
per-query lowest allowed key index (`window_floor`), so block-sparse kernels drop tiles
wholly outside the window from their block maps.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from mmjax.errors import UserError
from mmjax.models.attention_names import IMPLEMENTATIONS
# the mask vocabulary, imported by callers of bam_attention from here too
from mmjax.models.attention_mask import (MASK_FAMILIES, NO_FLOOR, NO_OPTIONS,  # noqa: F401
                                         AttnOptions, TokenMeta, allowed_mask, cap_logits,
                                         causal_meta, causal_segment_mask, full_meta,
                                         meta_mask, segment_mask, segment_meta,
                                         window_floor)

CUDNN_FAMILIES = ("causal", "full")
# auto on CPU: the dense path up to this many (query, key) pairs per row (512 x 512), chunked
# beyond (the crossover scripts/bench_attention.py measures).
AUTO_DENSE_MAX_PAIRS = 1 << 18


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


def dot_product_attention(q, k, v, allowed, softcap: float | None = None,
                          scale: float | None = None):
    """Masked softmax attention with grouped-query heads.

    q: [B, Sq, H, D]; k, v: [B, Sk, KV, D] with H a multiple of KV; allowed: bool broadcastable
    to [B, Sq, Sk]. Softmax runs in float32; a query with no allowed key outputs zeros.
    `scale` (default D ** -0.5) multiplies the logits, then `softcap` caps them.
    """
    b, sq, h, d = q.shape
    kv = k.shape[2]
    # One head per kv head: the 4-D form ([B, H, Sq, Sk] logits). XLA:CPU runs the grouped
    # 5-D contraction 1.7x slower (fwd + bwd, 2 x 512 tokens, 8 heads of 64; docs/results.md,
    # "Overhead against a plain program"), so only grouped-query heads take it.
    grouped = kv != h
    if grouped:
        q = q.reshape(b, sq, kv, h // kv, d)
    logits = f32_einsum("bqkgd,bskd->bkgqs" if grouped else "bqhd,bshd->bhqs", q, k)
    logits = (logits / jnp.sqrt(d).astype(jnp.float32) if scale is None
              else logits * jnp.float32(scale))
    logits = cap_logits(logits, softcap)
    mask = allowed[:, None, None] if grouped else allowed[:, None]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    # a row with no allowed key softmaxes to uniform: zero it (masked keys of other rows
    # are exactly 0 already), by a per-row factor that fuses into the softmax
    probs = (probs * jnp.any(mask, axis=-1, keepdims=True)).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd" if grouped else "bhqs,bshd->bqhd", probs, v)
    return out.reshape(b, sq, h, d)


def choose_implementation(implementation: str, sq: int, sk: int, dtype, mask_family: str = "bam",
                          platform: str | None = None, options: AttnOptions = NO_OPTIONS) -> str:
    """The implementation `bam_attention` runs; "auto" picks by platform, mask and length.

    CPU: dense up to AUTO_DENSE_MAX_PAIRS pairs per row, chunked beyond (Pallas only runs in
    interpret mode there). GPU: cuDNN for bf16/fp16 plain causal or full masks, the Pallas
    (Triton) kernel for other long sequences (faster than chunked there: README), dense for
    short ones. "cudnn" off GPU or on a bitfield mask is a
    user error. cuDNN expresses a sliding window only as a static int on a causal mask and
    has no logit soft-capping: other options never pick it (`cudnn_options_error`).
    """
    if implementation not in IMPLEMENTATIONS:
        raise UserError(f"attention implementation {implementation!r} is unknown "
                         f"(use one of {list(IMPLEMENTATIONS)})")
    if mask_family not in MASK_FAMILIES:
        raise UserError(f"mask_family={mask_family!r} is unknown "
                         f"(use one of {list(MASK_FAMILIES)})")
    platform = platform or jax.default_backend()
    if implementation == "cudnn":
        cudnn_error(platform, mask_family, dtype)
        why = cudnn_options_error(mask_family, options)
        if why:
            raise ValueError(f"error: attention implementation 'cudnn' {why} (use 'pallas', "
                             f"'chunked', 'dense' or 'auto')")
        return "cudnn"
    if implementation != "auto":
        return implementation
    if platform == "gpu" and mask_family in CUDNN_FAMILIES and jnp.dtype(dtype) in (
            jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and not cudnn_options_error(
            mask_family, options):
        return "cudnn"
    if sq * sk <= AUTO_DENSE_MAX_PAIRS:
        return "dense"
    return "pallas" if platform == "gpu" else "chunked"


def cudnn_error(platform: str, mask_family: str, dtype) -> None:
    """Raise the one-line user error when cuDNN cannot run this attention (the mask first:
    no platform makes cuDNN run a bitfield mask)."""
    if mask_family not in CUDNN_FAMILIES:
        raise UserError("attention implementation 'cudnn' runs only plain causal or "
                         f"full masks (mask_family 'causal' / 'full'), got {mask_family!r} "
                         f"(use 'pallas' or 'auto')")
    if platform != "gpu":
        raise UserError(f"attention implementation 'cudnn' needs a GPU but the platform "
                         f"is {platform!r} (use 'chunked', 'pallas', 'dense' or 'auto')")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise UserError(f"attention implementation 'cudnn' needs bfloat16/float16 "
                         f"inputs, got {jnp.dtype(dtype).name} (set compute_dtype or use 'auto')")


def cudnn_options_error(mask_family: str, options: AttnOptions) -> str:
    """Why cuDNN cannot run these options ('' if it can): its sliding window is a static
    left window on a causal mask, and it has no logit soft-capping."""
    if options.softcap is not None:
        return f"has no attention-logit soft-capping (softcap={options.softcap})"
    if options.window is not None:
        if not isinstance(options.window, int):
            return "takes only a static sliding window (this one varies per layer in a scan)"
        if mask_family != "causal":
            return f"takes a sliding window only on the causal mask family, not {mask_family!r}"
    return ""


def _check_inputs(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"bam_attention: q must be [B, Sq, H, D] and k, v [B, Sk, KV, D]; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.shape[2] % k.shape[2] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"bam_attention: q {q.shape} and k {k.shape} disagree on batch or head "
                         f"dim, or query heads are not a multiple of kv heads")
    for name, meta, x in (("meta_q", meta_q, q), ("meta_k", meta_k, k)):
        for f, a in zip(TokenMeta._fields, meta):
            if tuple(a.shape) != tuple(x.shape[:2]):
                raise ValueError(f"bam_attention: {name}.{f} has shape {a.shape}, expected "
                                 f"{tuple(x.shape[:2])}")


def shared_tiles(meta: TokenMeta, implementation: str = "auto", mask_family: str = "bam"):
    """The Pallas kernel's block lists for self-attention over `meta`, built once and shared
    by every layer of a stack (each layer would rebuild the same lists: a sequential map over
    query blocks per layer), when `implementation` runs the Pallas kernel at this length in
    any dtype; None otherwise. Layers with a sliding window build their own."""
    s = meta.doc.shape[-1]
    picks = {choose_implementation(implementation, s, s, dt, mask_family)
             for dt in (jnp.float32, jnp.bfloat16)}
    if picks != {"pallas"}:
        return None
    from mmjax.models.attention_pallas import tile_lists

    return tile_lists(TokenMeta(*(jnp.asarray(a, jnp.int32) for a in meta)))


def bam_attention(q, k, v, meta_q: TokenMeta, meta_k: TokenMeta | None = None, *,
                  implementation: str = "auto", mask_family: str = "bam",
                  options: AttnOptions = NO_OPTIONS, tiles=None):
    """Attention under the bitfield mask given by token metadata (Cornstarch §4.3.1).

    q: [B, Sq, H, D]; k, v: [B, Sk, KV, D] (H a multiple of KV: grouped-query heads);
    meta_q / meta_k: TokenMeta of int32 [B, Sq] / [B, Sk] (meta_k defaults to meta_q).
    Softmax in float32; a query with no allowed key outputs zeros (and gets zero gradients).
    `options`: sliding window, logit soft-capping and scale (`AttnOptions`); `tiles`: the
    Pallas kernel's block lists of this metadata (`shared_tiles`, built once for all layers).
    Every implementation computes the same function (see the module docstring).
    """
    meta_k = meta_q if meta_k is None else meta_k
    meta_q = TokenMeta(*(jnp.asarray(a, jnp.int32) for a in meta_q))
    meta_k = TokenMeta(*(jnp.asarray(a, jnp.int32) for a in meta_k))
    _check_inputs(q, k, v, meta_q, meta_k)
    impl = choose_implementation(implementation, q.shape[1], k.shape[1], q.dtype, mask_family,
                                 options=options)
    window, softcap, scale = options
    if impl == "dense":
        floor = None if window is None else window_floor(meta_q, window)
        return dot_product_attention(q, k, v, meta_mask(meta_q, meta_k, floor), softcap, scale)
    if impl == "chunked":
        from mmjax.models.attention_chunked import chunked_attention
        return chunked_attention(q, k, v, meta_q, meta_k, window=window, softcap=softcap,
                                 scale=scale)
    if impl == "pallas":
        from mmjax.models.attention_pallas import pallas_attention
        return pallas_attention(q, k, v, meta_q, meta_k, window=window, softcap=softcap,
                                scale=scale, tiles=tiles)
    from mmjax.models.attention_cudnn import cudnn_attention
    assert window is None or isinstance(window, int)  # cudnn_options_error: a static window
    return cudnn_attention(q, k, v, meta_q, meta_k, causal=mask_family == "causal",
                           window=window, scale=scale)
