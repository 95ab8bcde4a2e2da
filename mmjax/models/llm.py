"""Llama/Qwen2-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU.

`LLM(cfg, key, start, end)` holds decoder layers [start, end) (a pipeline stage), plus the
token embedding when start == 0 and the final norm / LM head when end == num_layers. Layer
i's weights come from `fold_in(key, i)`, so a stage equals the same slice of the whole
model. Every projection goes through `ops` (column: QKV and gate/up; row: output and down),
the hook overlapped tensor parallelism replaces; attention goes through `attend(q, k, v)`,
the hook context parallelism replaces.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from mmjax.models.attention import TokenMeta, bam_attention, dot_product_attention, f32_einsum
from mmjax.models.config import LLMConfig
from mmjax.models.layers import PLAIN, RMSNorm, param, rope, zeros
from mmjax.models.scan import run_stack


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LLMConfig, key):
        d, hd, f = cfg.hidden_size, cfg.dim_per_head, cfg.ffn_size
        hq, hkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        ks = jax.random.split(key, 7)
        self.head_dim, self.theta, self.llama3 = hd, cfg.rope_theta, cfg.rope_llama3
        self.mrope = cfg.mrope_section
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.wq = param(ks[0], (d, hq), d ** -0.5)
        self.wk = param(ks[1], (d, hkv), d ** -0.5)
        self.wv = param(ks[2], (d, hkv), d ** -0.5)
        self.bq = zeros((hq,)) if cfg.qkv_bias else None
        self.bk = zeros((hkv,)) if cfg.qkv_bias else None
        self.bv = zeros((hkv,)) if cfg.qkv_bias else None
        self.wo = param(ks[3], (hq, d), hq ** -0.5)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.w_gate = param(ks[4], (d, f), d ** -0.5)
        self.w_up = param(ks[5], (d, f), d ** -0.5)
        self.w_down = param(ks[6], (f, d), f ** -0.5)

    def __call__(self, x, positions, attend, ops=PLAIN):
        dt = x.dtype
        w = lambda p: p[...].astype(dt)
        h = self.attn_norm(x)
        q, k, v = ops.column(h, w(self.wq), w(self.wk), w(self.wv))
        if self.bq is not None:
            q, k, v = q + w(self.bq), k + w(self.bk), v + w(self.bv)
        heads = lambda t: t.reshape(*t.shape[:2], -1, self.head_dim)
        q = rope(heads(q), positions, self.theta, self.llama3, self.mrope)
        k = rope(heads(k), positions, self.theta, self.llama3, self.mrope)
        o = attend(q, k, heads(v))
        x = x + ops.row(o.reshape(*o.shape[:2], -1), w(self.wo))
        g, u = ops.column(self.mlp_norm(x), w(self.w_gate), w(self.w_up))
        return x + ops.row(jax.nn.silu(g) * u, w(self.w_down))


def mask_attend(allowed):
    """Attention hook with a precomputed dense [B, S, S] mask (tests, small examples)."""
    return lambda q, k, v: dot_product_attention(q, k, v, allowed)


def meta_attend(meta: TokenMeta, attention_impl: str = "auto", mask_family: str = "bam"):
    """The default attention hook: `bam_attention` from the tokens' metadata, so no
    implementation but "dense" ever builds the [B, S, S] mask. `mask_family="causal"`
    promises one causal document per row, real tokens first (text-only batches, one sample
    per row: `AssemblyLayout.llm_mask_family`), which lets "auto" pick cuDNN on a GPU."""
    return lambda q, k, v: bam_attention(q, k, v, meta, implementation=attention_impl,
                                         mask_family=mask_family)


class LLM(nnx.Module):
    def __init__(self, cfg: LLMConfig, key, start: int = 0, end: int | None = None):
        end = cfg.num_layers if end is None else end
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"LLM layer range [{start}, {end}) outside 0..{cfg.num_layers}")
        self.cfg, self.start, self.end = cfg, start, end
        self.is_first, self.is_last = start == 0, end == cfg.num_layers
        k_embed, k_layers, k_head = (jax.random.fold_in(key, i) for i in range(3))
        d, v = cfg.hidden_size, cfg.vocab_size
        # A tied last stage keeps its own copy of the embedding (Megatron's embedding group);
        # the pipeline runtime sums the two copies' gradients every step.
        has_embed = self.is_first or (self.is_last and cfg.tie_embeddings)
        self.embed = param(k_embed, (v, d), 0.02) if has_embed else None
        self.layers = nnx.List([DecoderLayer(cfg, jax.random.fold_in(k_layers, i))
                                for i in range(start, end)])
        self.final_norm = RMSNorm(d, cfg.norm_eps) if self.is_last else None
        untied_head = self.is_last and not cfg.tie_embeddings
        self.lm_head = param(k_head, (d, v), d ** -0.5) if untied_head else None

    def embed_tokens(self, tokens, dtype=jnp.float32):
        return self.embed[...].astype(dtype)[tokens]

    def run_layers(self, x, positions, attend, ops=PLAIN):
        return run_stack(self.layers, x, lambda layer, h: layer(h, positions, attend, ops),
                         self.cfg.scan_layers, self.cfg.remat)

    def final_hidden(self, x):
        return self.final_norm(x)

    def logits(self, h):
        """h: final-normed hidden states -> float32 logits."""
        w = self.embed[...].T if self.lm_head is None else self.lm_head[...]
        return f32_einsum("...d,dv->...v", h, w.astype(h.dtype))

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
