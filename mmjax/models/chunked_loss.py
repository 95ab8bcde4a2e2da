"""The LM head and its cross-entropy fused over token chunks, gradients taken in the forward.

The plain path (`LLM.logits` then `lm_loss_sum`) materialises float32 logits [tokens, vocab]
and their gradient: at a 128k vocabulary that is 1 MB per token, 16 GB for 16k tokens, and
several passes of memory traffic over it. Here a `lax.scan` over chunks of `chunk` tokens
computes each chunk's logits, its cross-entropy and, in the same pass, the chunk's logit
gradient (softmax - one-hot) and from it the gradients of the hidden states and of the
head's weight (as Liger-Kernel's fused linear cross-entropy does). Only one chunk's logits
live at a time; no matmul is recomputed; the backward only scales the stored gradients by
the incoming cotangent. Float32 everywhere a sum is taken; the matmuls run on the compute
dtype's operands, as `f32_einsum`'s backward does.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def chunked_lm_loss_sum(h, w, targets, loss_mask, softcap: float | None, chunk: int):
    """Sum over scored positions of next-token cross-entropy of logits h @ w (soft-capped).

    h [..., d] final-normed hidden states; w [d, V] the head; targets, loss_mask [...]."""
    d = h.shape[-1]
    hf = h.reshape(-1, d)
    t = targets.reshape(-1).astype(jnp.int32)
    m = loss_mask.reshape(-1).astype(jnp.float32)
    n = hf.shape[0]
    chunk = max(1, min(int(chunk), n))
    pad = -n % chunk
    if pad:
        hf = jnp.pad(hf, ((0, pad), (0, 0)))
        t, m = jnp.pad(t, (0, pad)), jnp.pad(m, (0, pad))
    return _fused(hf, w.astype(h.dtype), t, m, softcap, chunk)


def _chunk_grads(hc, w, tc, mc, softcap):
    """One chunk: (loss sum, d loss / d hc in hc's dtype, d loss / d w in float32)."""
    z = jnp.einsum("nd,dv->nv", hc, w, preferred_element_type=jnp.float32)
    if softcap is not None:
        tz = jnp.tanh(z / softcap)
        z = softcap * tz
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]
    loss = jnp.sum((lse - picked) * mc)
    onehot = jnp.arange(z.shape[-1], dtype=jnp.int32)[None, :] == tc[:, None]
    g = (jnp.exp(z - lse[:, None]) - onehot) * mc[:, None]
    if softcap is not None:
        g = g * (1.0 - tz * tz)
    g = g.astype(hc.dtype)
    dh = jnp.einsum("nv,dv->nd", g, w, preferred_element_type=jnp.float32).astype(hc.dtype)
    dw = jnp.einsum("nd,nv->dv", hc, g, preferred_element_type=jnp.float32)
    return loss, dh, dw


def _forward(hf, w, t, m, softcap, chunk):
    k = hf.shape[0] // chunk
    xs = (hf.reshape(k, chunk, -1), t.reshape(k, chunk), m.reshape(k, chunk))

    def body(carry, x):
        loss, dw = carry
        lc, dh, dwc = _chunk_grads(*x[:1], w, *x[1:], softcap)
        return (loss + lc, dw + dwc), dh

    init = (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (loss, dw), dh = jax.lax.scan(body, init, xs)
    return loss, dh.reshape(hf.shape), dw


def _loss_only(hf, w, t, m, softcap, chunk):
    """The primal without gradients (evaluation): the same chunked sum."""
    k = hf.shape[0] // chunk

    def body(loss, x):
        hc, tc, mc = x
        z = jnp.einsum("nd,dv->nv", hc, w, preferred_element_type=jnp.float32)
        if softcap is not None:
            z = softcap * jnp.tanh(z / softcap)
        picked = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]
        return loss + jnp.sum((jax.nn.logsumexp(z, axis=-1) - picked) * mc), None

    xs = (hf.reshape(k, chunk, -1), t.reshape(k, chunk), m.reshape(k, chunk))
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(hf, w, t, m, softcap, chunk):
    return _loss_only(hf, w, t, m, softcap, chunk)


def _fused_fwd(hf, w, t, m, softcap, chunk):
    loss, dh, dw = _forward(hf, w, t, m, softcap, chunk)
    return loss, (dh, dw, t, m)


def _fused_bwd(softcap, chunk, res, g):
    dh, dw, t, m = res
    zero_t = jnp.zeros(t.shape, jax.dtypes.float0)
    return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw).astype(dh.dtype),
            zero_t, jnp.zeros_like(m))


_fused.defvjp(_fused_fwd, _fused_bwd)
