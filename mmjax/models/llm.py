"""Llama/Qwen2-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, and the options
of the other decoder families (Qwen3's q/k norms; Gemma 2 / 3's (1 + w) and sandwich norms,
embedding scale, soft-capping, GeGLU and local/global layers; sliding windows).

`LLM(cfg, key, start, end)` holds decoder layers [start, end) (a pipeline stage), plus the
token embedding when start == 0 and the final norm / LM head when end == num_layers. Layer
i's weights come from `fold_in(key, i)`, so a stage equals the same slice of the whole
model. Every projection goes through `ops` (column: QKV and gate/up; row: output and down),
the hook overlapped tensor parallelism replaces; attention goes through
`attend(q, k, v, options)` (`attention.AttnOptions`: the layer's window, soft-cap, scale),
the hook context parallelism replaces.

Layers that differ only in being local (sliding window, local RoPE base) or global, as
Gemma's, keep one structure: the flag is an argument of the layer call, a Python bool in a
loop and a traced per-layer bool carried through the layer scan (`scan.run_stack`'s
per-layer inputs), which selects the RoPE table and the window inside the scanned body.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from mmjax.models.chunked_loss import chunked_lm_loss_sum
from mmjax.models.attention import (AttnOptions, TokenMeta, bam_attention, cap_logits,
                                    shared_tiles,
                                    dot_product_attention, f32_einsum)
from mmjax.models.config import LLMConfig
from mmjax.models.layers import (ACTIVATIONS, PLAIN, RMSNorm, apply_rope, param,
                                 rope_attention_factor, rope_inv_freq, zeros)
from mmjax.models.lora import adapt, adapters
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range

# A traced window this wide is no window (a global layer inside a layer scan).
NO_WINDOW = 1 << 30


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LLMConfig, key):
        d, hd, f = cfg.hidden_size, cfg.dim_per_head, cfg.ffn_size
        hq, hkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        ks = jax.random.split(key, 7)
        eps, g = cfg.norm_eps, cfg.gemma_norms
        self.head_dim, self.theta, self.scaling = hd, cfg.rope_theta, cfg.rope_scaling
        self.local_theta, self.mrope = cfg.rope_local_theta, cfg.mrope_section
        self.window, self.act = cfg.sliding_window, cfg.mlp_act
        self.softcap, self.scale = cfg.attn_softcap, cfg.attn_scale
        self.attn_norm = RMSNorm(d, eps, g)
        self.wq = param(ks[0], (d, hq), d ** -0.5)
        self.wk = param(ks[1], (d, hkv), d ** -0.5)
        self.wv = param(ks[2], (d, hkv), d ** -0.5)
        self.bq = zeros((hq,)) if cfg.qkv_bias else None
        self.bk = zeros((hkv,)) if cfg.qkv_bias else None
        self.bv = zeros((hkv,)) if cfg.qkv_bias else None
        self.q_norm = RMSNorm(hd, eps, g) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, g) if cfg.qk_norm else None
        self.wo = param(ks[3], (hq, d), hq ** -0.5)
        self.attn_post_norm = RMSNorm(d, eps, g) if cfg.sandwich_norms else None
        self.mlp_norm = RMSNorm(d, eps, g)
        self.w_gate = param(ks[4], (d, f), d ** -0.5)
        self.w_up = param(ks[5], (d, f), d ** -0.5)
        self.w_down = param(ks[6], (f, d), f ** -0.5)
        self.mlp_post_norm = RMSNorm(d, eps, g) if cfg.sandwich_norms else None
        self.lora = adapters(key, {"q": (d, hq), "k": (d, hkv), "v": (d, hkv), "o": (hq, d),
                                   "gate": (d, f), "up": (d, f), "down": (f, d)},
                             cfg.lora, "llm")

    def _rope_and_window(self, local):
        """(inverse frequencies, cos/sin factor, window) of a local or global layer; `local`
        is a Python bool or a traced one (inside a layer scan)."""
        glob = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        factor = rope_attention_factor(self.scaling)
        loc = glob if self.local_theta is None else rope_inv_freq(self.head_dim,
                                                                 self.local_theta)
        loc_factor = factor if self.local_theta is None else 1.0
        if self.window is None:
            return glob, factor, None
        if isinstance(local, (bool, np.bool_)):
            return (loc, loc_factor, self.window) if local else (glob, factor, None)
        return (jnp.where(local, loc, glob), jnp.where(local, loc_factor, factor),
                jnp.where(local, self.window, NO_WINDOW).astype(jnp.int32))

    def __call__(self, x, positions, attend, ops=PLAIN, local=True):
        """`local`: does this layer slide its window (ignored without cfg.sliding_window)."""
        dt = x.dtype
        w = lambda p: p[...].astype(dt)
        h = self.attn_norm(x)
        q, k, v = ops.column(h, w(self.wq), w(self.wk), w(self.wv))
        q, k, v = (adapt(self.lora, n, h, t) for n, t in zip("qkv", (q, k, v)))
        if self.bq is not None:
            q, k, v = q + w(self.bq), k + w(self.bk), v + w(self.bv)
        heads = lambda t: t.reshape(*t.shape[:2], -1, self.head_dim)
        q, k = heads(q), heads(k)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv, factor, window = self._rope_and_window(local)
        q = apply_rope(q, positions, inv, factor, self.mrope)
        k = apply_rope(k, positions, inv, factor, self.mrope)
        o = attend(q, k, heads(v), AttnOptions(window, self.softcap, self.scale))
        o = o.reshape(*o.shape[:2], -1)
        o = adapt(self.lora, "o", o, ops.row(o, w(self.wo)))
        x = x + (o if self.attn_post_norm is None else self.attn_post_norm(o))
        hm = self.mlp_norm(x)
        g, u = ops.column(hm, w(self.w_gate), w(self.w_up))
        g, u = adapt(self.lora, "gate", hm, g), adapt(self.lora, "up", hm, u)
        a = ACTIVATIONS[self.act](g) * u
        y = adapt(self.lora, "down", a, ops.row(a, w(self.w_down)))
        return x + (y if self.mlp_post_norm is None else self.mlp_post_norm(y))


def window_mask(allowed, q_idx, k_idx, window):
    """`allowed` [B, Sq, Sk] narrowed to the sliding window (q_idx [B, Sq] / k_idx [B, Sk]
    token indices; window None: unchanged)."""
    if window is None:
        return allowed
    return allowed & (q_idx[:, :, None] - k_idx[:, None, :] < window)


def attention_options(cfg: LLMConfig) -> list[AttnOptions]:
    """The distinct `AttnOptions` the layers of `cfg` pass their hook (a traced window where
    a layer scan carries differing local/global flags), to validate an attention choice
    before any work (`pipeline/stage.py`)."""
    if cfg.scan_layers and cfg.layers_differ:
        return [AttnOptions(jnp.int32(cfg.sliding_window), cfg.attn_softcap, cfg.attn_scale)]
    windows = {cfg.sliding_window if cfg.is_sliding(i) else None for i in range(cfg.num_layers)}
    return [AttnOptions(w, cfg.attn_softcap, cfg.attn_scale) for w in sorted(
        windows, key=lambda w: -1 if w is None else w)]


def mask_attend(allowed):
    """Attention hook with a precomputed dense [B, S, S] mask (tests, small examples); a
    layer's window narrows it by token index."""
    def attend(q, k, v, options=AttnOptions()):
        window, softcap, scale = options
        if window is not None:
            idx = lambda x: jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
            allowed_w = window_mask(jnp.broadcast_to(allowed, (q.shape[0],) + allowed.shape[1:]),
                                    idx(q), idx(k), window)
        else:
            allowed_w = allowed
        return dot_product_attention(q, k, v, allowed_w, softcap, scale)
    return attend


def meta_attend(meta: TokenMeta, attention_impl: str = "auto", mask_family: str = "bam"):
    """The default attention hook: `bam_attention` from the tokens' metadata, so no
    implementation but "dense" ever builds the [B, S, S] mask. `mask_family="causal"`
    promises one causal document per row, real tokens first (text-only batches, one sample
    per row: `AssemblyLayout.llm_mask_family`), which lets "auto" pick cuDNN on a GPU. The
    Pallas kernel's block lists are built here once for every layer (`shared_tiles`)."""
    tiles = shared_tiles(meta, attention_impl, mask_family)
    return lambda q, k, v, options=AttnOptions(): bam_attention(
        q, k, v, meta, implementation=attention_impl, mask_family=mask_family,
        options=options, tiles=tiles)


class LLM(nnx.Module):
    def __init__(self, cfg: LLMConfig, key, start: int = 0, end: int | None = None):
        end, self.is_first, self.is_last = layer_range("LLM layer", cfg.num_layers, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_embed, k_layers, k_head = (jax.random.fold_in(key, i) for i in range(3))
        d, v = cfg.hidden_size, cfg.vocab_size
        # A tied last stage keeps its own copy of the embedding (Megatron's embedding group);
        # the pipeline runtime sums the two copies' gradients every step.
        has_embed = self.is_first or (self.is_last and cfg.tie_embeddings)
        self.embed = param(k_embed, (v, d), 0.02) if has_embed else None
        self.layers = nnx.List([DecoderLayer(cfg, jax.random.fold_in(k_layers, i))
                                for i in range(start, end)])
        self.final_norm = RMSNorm(d, cfg.norm_eps, cfg.gemma_norms) if self.is_last else None
        untied_head = self.is_last and not cfg.tie_embeddings
        self.lm_head = param(k_head, (d, v), d ** -0.5) if untied_head else None

    def embed_tokens(self, tokens, dtype=jnp.float32):
        x = self.embed[...].astype(dtype)[tokens]
        if self.cfg.embed_scale:  # Gemma: the scale rounded to the compute dtype, as HF's
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, dtype)
        return x

    def local_flags(self) -> np.ndarray:
        """bool [end - start]: which of this stage's layers are local (sliding window)."""
        return np.array([self.cfg.is_sliding(i) for i in range(self.start, self.end)])

    def run_layers(self, x, positions, attend, ops=PLAIN):
        return run_stack(self.layers, x,
                         lambda layer, h, local: layer(h, positions, attend, ops, local),
                         self.cfg.scan_layers, per_layer=self.local_flags(),
                         remat=self.cfg.remat)

    def final_hidden(self, x):
        return self.final_norm(x)

    def logits(self, h):
        """h: final-normed hidden states -> float32 logits (soft-capped for Gemma 2)."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return cap_logits(f32_einsum("...d,dv->...v", h, w.astype(h.dtype)),
                          self.cfg.final_softcap)

    def loss_sum(self, h, targets, loss_mask):
        """Summed next-token cross-entropy of the final-normed `h` over scored positions:
        `cfg.loss_chunk` > 0 fuses the head and the loss over chunks of that many tokens
        (`models/chunked_loss.py`: no [tokens, vocab] float32 logits in memory)."""
        if not self.cfg.loss_chunk:
            return lm_loss_sum(self.logits(h), targets, loss_mask)
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return chunked_lm_loss_sum(h, w, targets, loss_mask, self.cfg.final_softcap,
                                   self.cfg.loss_chunk)

    def __call__(self, tokens, positions, allowed, ops=PLAIN, attention_impl: str = "auto"):
        """Whole-model convenience: tokens -> logits; `allowed` is a dense [B, S, S] mask or
        the tokens' TokenMeta (then attention runs `attention_impl`)."""
        x = self.embed_tokens(tokens)
        attend = (meta_attend(allowed, attention_impl) if isinstance(allowed, TokenMeta)
                  else mask_attend(allowed))
        h = self.final_hidden(self.run_layers(x, positions, attend, ops))
        return self.logits(h)


def merge_modalities(x, enc_outputs: dict, gathers: dict):
    """Embed encoder outputs at placeholder positions: x [B, S, d]; enc_outputs[name]
    [N, d]; gathers[name] [B, S] index into it, -1 where the token is not that modality."""
    for name, out in enc_outputs.items():
        g = gathers[name]
        picked = out.astype(x.dtype)[jnp.clip(g, 0, max(out.shape[0] - 1, 0))]
        x = jnp.where((g >= 0)[..., None], picked, x)
    return x


def lm_loss_sum(logits, targets, loss_mask):
    """Sum (not mean) of next-token cross-entropy over scored positions, in float32; the
    caller divides by the global target count so reordering samples changes nothing."""
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(ce * loss_mask.astype(jnp.float32))
