"""Autoregressive decoding with a KV cache (pure functions over the model, no I/O).

Prefill runs the prompt (text, with image / audio tokens merged at their placeholders, the
training attention mask: causal text, bidirectional inside each image / clip) through the
LLM once and keeps every layer's keys and values; each decode step then runs one token
against the cache. Sampling: greedy (temperature 0), temperature, and nucleus (top-p:
the smallest set of most likely tokens whose probability reaches p, renormalised).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.attention import NO_OPTIONS, dot_product_attention
from mmjax.models.llm import LLM, window_mask
from mmjax.models.mllm import encode, llm_allowed, llm_embed


class KVCache(NamedTuple):
    k: jax.Array  # [layers, B, max_len, kv_heads, head_dim]
    v: jax.Array


def empty_cache(cfg, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.dim_per_head)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def _run_cached(llm, x, positions, allowed, cache: KVCache, start):
    """x [B, T, d] at cache slots [start, start + T) -> (last position's logits, cache)."""
    ks, vs = [], []
    flags = llm.local_flags()
    for i, layer in enumerate(llm.layers):
        def attend(q, k, v, options=NO_OPTIONS, i=i):
            ck = jax.lax.dynamic_update_slice(cache.k[i], k.astype(cache.k.dtype), (0, start, 0, 0))
            cv = jax.lax.dynamic_update_slice(cache.v[i], v.astype(cache.v.dtype), (0, start, 0, 0))
            ks.append(ck)
            vs.append(cv)
            slots = lambda n, s0: jnp.broadcast_to(s0 + jnp.arange(n), (q.shape[0], n))
            mask = window_mask(allowed, slots(q.shape[1], start), slots(ck.shape[1], 0),
                               options.window)  # cache slots are the tokens' indices
            return dot_product_attention(q, ck.astype(q.dtype), cv.astype(q.dtype), mask,
                                         options.softcap, options.scale)
        x = layer(x, positions, attend, local=flags[i])
    logits = llm.logits(llm.final_hidden(x[:, -1:]))[:, 0]
    return logits, KVCache(jnp.stack(ks), jnp.stack(vs))


def _prefill_llm(llm, x, positions, allowed, max_len: int):
    p = x.shape[1]
    allowed = jnp.pad(allowed, ((0, 0), (0, 0), (0, max_len - p)))
    return _run_cached(llm, x, positions, allowed, empty_cache(llm.cfg, x.shape[0], max_len), 0)


@partial(jax.jit, static_argnums=(0, 3, 4))
def prefill(graphdef, state, batch, prompt_len: int, max_len: int):
    """Run the first `prompt_len` positions of row 0..B of `batch` (model inputs of an
    assembled prompt); -> (logits of the last prompt token [B, V], cache)."""
    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    enc = {e.name: encode(e, model.encoders[e.name], model.projectors[e.name],
                          batch["encoders"][e.name]) for e in cfg.encoders}
    x = llm_embed(cfg, model.llm, batch, enc)[:, :prompt_len]
    allowed = llm_allowed(batch)[:, :prompt_len, :prompt_len]
    return _prefill_llm(model.llm, x, batch["positions"][:, :prompt_len], allowed, max_len)


def prefill_embedded(llm, x, positions, allowed, max_len: int):
    """Prefill from input embeddings already made (x [B, P, d], RoPE positions, allowed
    [B, P, P]) through `llm` (an `LLM`); -> (last position's logits [B, V], cache). Traced
    inside the caller's jit (`hf/generate.py`)."""
    return _prefill_llm(llm, x, positions, allowed, max_len)


def next_rope_position(positions, prompt_len: int):
    """[B] RoPE position of the first token after the prompt: one past the largest position
    the prompt used. Plain RoPE: prompt_len (positions 0..prompt_len-1). M-RoPE (positions
    [B, S, 3]): an image's tokens span fewer positions than tokens, so generated tokens
    run ahead of their cache slots by that "rope delta", as transformers' Qwen2-VL
    (`cache_position + rope_deltas`, all three sections equal)."""
    p = positions[:, :prompt_len]
    return (p.max(axis=tuple(range(1, p.ndim))) + 1).astype(jnp.int32)


@partial(jax.jit, static_argnums=(0,))
def decode_step(graphdef, state, token, position, cache: KVCache, rope_position=None,
                key_valid=None):
    """One token [B] at cache slot `position` and RoPE position `rope_position` [B]
    (default: the slot; `next_rope_position` + steps taken after an M-RoPE prompt)
    -> (next-token logits [B, V], cache). `key_valid` [B, max_len] (default: every slot):
    False at the cache slots of padding, which no token attends to. The model is a
    `MultimodalModel` or a bare `LLM`."""
    model = nnx.merge(graphdef, state)
    llm = model if isinstance(model, LLM) else model.llm
    x = llm.embed_tokens(token[:, None])
    b, max_len = token.shape[0], cache.k.shape[2]
    allowed = jnp.broadcast_to(jnp.arange(max_len) <= position, (b, 1, max_len))
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, :]
    rope = jnp.broadcast_to(position if rope_position is None else rope_position, (b,))
    pos = rope.astype(jnp.int32)[:, None]
    if llm.cfg.mrope_section:  # M-RoPE: the same position in every section
        pos = jnp.repeat(pos[..., None], 3, axis=-1)
    return _run_cached(llm, x, pos, allowed, cache, position)


def sample_token(logits, key, temperature: float = 0.0, top_p: float = 1.0, vocab: int | None = None):
    """Next token [B] from logits [B, V]; ids >= `vocab` (embedding padding) never chosen."""
    if vocab is not None and vocab < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab, logits, -jnp.inf)
    if temperature <= 0.0:
        return jnp.argmax(logits, axis=-1)
    probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    order = jnp.argsort(-probs, axis=-1)
    sorted_p = jnp.take_along_axis(probs, order, axis=-1)
    before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass of strictly more likely tokens
    keep_sorted = before < top_p  # the first token is always kept
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(probs.shape[0])[:, None], order].set(keep_sorted)
    masked = jnp.where(keep, jnp.log(probs), -jnp.inf)
    return jax.random.categorical(key, masked, axis=-1)


def generate(model, batch, prompt_len: int, max_new_tokens: int, stop_ids=(),
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
             vocab: int | None = None) -> list[int]:
    """Token ids generated after the prompt (row 0), stopping at a stop id (not included)."""
    graphdef, state = nnx.split(model)
    max_len = prompt_len + max_new_tokens
    logits, cache = prefill(graphdef, state, batch, prompt_len, max_len)
    rope = next_rope_position(jnp.asarray(batch["positions"]), prompt_len)
    key = jax.random.key(seed)
    out = []
    for t in range(max_new_tokens):
        key, sub = jax.random.split(key)
        token = sample_token(logits, sub, temperature, top_p, vocab)
        tok = int(token[0])
        if tok in stop_ids:
            break
        out.append(tok)
        if t + 1 < max_new_tokens:
            logits, cache = decode_step(graphdef, state, token.astype(jnp.int32),
                                        jnp.int32(prompt_len + t), cache, rope + t)
    return out
