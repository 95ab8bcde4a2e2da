"""Encoder -> LLM projectors.

`MLPProjector`: concatenate `downsample` consecutive encoder tokens (OrchMLLM §8 rates
1/2/4), then 1 (Cornstarch: a single linear layer) or 2 dense layers with GELU (LLaVA;
`ProjectorConfig.act`: tanh-approximated or exact).
`CrossAttentionProjector`: `num_queries` learned queries per item cross-attend to that
item's encoder tokens (items told apart by segment ids), then a 2-layer MLP to the LLM width
(Perceiver-resampler style). Both return [N, tokens_per_row, llm_hidden].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.attention import TokenMeta, bam_attention, segment_meta
from mmjax.models.config import ProjectorConfig
from mmjax.models.layers import Dense, LayerNorm, param
from mmjax.models.qwen2_vl_vision import PatchMergerMLP


class MLPProjector(nnx.Module):
    def __init__(self, cfg: ProjectorConfig, enc_dim: int, llm_dim: int, key):
        if cfg.num_layers not in (1, 2):
            raise ValueError(f"ProjectorConfig.num_layers={cfg.num_layers}: use 1 or 2")
        if cfg.act not in ("gelu_tanh", "gelu"):
            raise ValueError(f"ProjectorConfig.act={cfg.act!r}: use 'gelu_tanh' or 'gelu'")
        self.r, self.exact = cfg.downsample, cfg.act == "gelu"
        din, h = enc_dim * cfg.downsample, cfg.hidden_size or llm_dim
        k1, k2 = jax.random.split(key)
        if cfg.num_layers == 1:
            self.fc1, self.fc2 = Dense(k1, din, llm_dim, lora=cfg.lora, kind="projector"), None
        else:
            self.fc1 = Dense(k1, din, h, lora=cfg.lora, kind="projector", name="fc1")
            self.fc2 = Dense(k2, h, llm_dim, lora=cfg.lora, kind="projector", name="fc2")

    def __call__(self, x, segment_ids=None, attention_impl: str = "auto"):
        n, t, e = x.shape
        if t % self.r:
            raise ValueError(f"encoder capacity {t} not a multiple of downsample {self.r}")
        x = x.reshape(n, t // self.r, e * self.r)
        x = self.fc1(x)
        return x if self.fc2 is None else self.fc2(jax.nn.gelu(x, approximate=not self.exact))


class CrossAttentionProjector(nnx.Module):
    def __init__(self, cfg: ProjectorConfig, enc_dim: int, llm_dim: int, key):
        ks = jax.random.split(key, 7)
        self.nq, self.heads, self.max_items = cfg.num_queries, cfg.num_heads, cfg.max_items
        h = cfg.hidden_size or llm_dim
        self.queries = param(ks[0], (cfg.num_queries, enc_dim))
        self.ln_q, self.ln_kv = LayerNorm(enc_dim), LayerNorm(enc_dim)
        self.q, self.k = Dense(ks[1], enc_dim, enc_dim), Dense(ks[2], enc_dim, enc_dim)
        self.v, self.o = Dense(ks[3], enc_dim, enc_dim), Dense(ks[4], enc_dim, enc_dim)
        self.fc1, self.fc2 = Dense(ks[5], enc_dim, h), Dense(ks[6], h, llm_dim)

    def __call__(self, x, segment_ids, attention_impl: str = "auto"):
        """x [N, T, e], segment_ids [N, T] (1-based item ids; 0 = padding) ->
        [N, max_items * num_queries, llm_dim]; slot s's queries see only item s+1."""
        n, t, e = x.shape
        dt = x.dtype
        q0 = jnp.broadcast_to(self.queries[...].astype(dt), (n, self.max_items, self.nq, e))
        q0 = q0.reshape(n, self.max_items * self.nq, e)
        slot = jnp.broadcast_to(jnp.repeat(jnp.arange(1, self.max_items + 1, dtype=jnp.int32),
                                           self.nq), (n, self.max_items * self.nq))
        meta_q = TokenMeta(jnp.full_like(slot, 2), slot, slot, jnp.zeros_like(slot))
        split = lambda a: a.reshape(*a.shape[:2], self.heads, e // self.heads)
        kv = self.ln_kv(x)
        att = bam_attention(split(self.q(self.ln_q(q0))), split(self.k(kv)), split(self.v(kv)),
                            meta_q, segment_meta(segment_ids), implementation=attention_impl)
        y = q0 + self.o(att.reshape(n, -1, e))
        return self.fc2(jax.nn.gelu(self.fc1(y), approximate=True))


def make_projector(cfg: ProjectorConfig, enc_dim: int, llm_dim: int, key):
    if cfg.kind == "mlp":
        return MLPProjector(cfg, enc_dim, llm_dim, key)
    if cfg.kind == "cross_attention":
        return CrossAttentionProjector(cfg, enc_dim, llm_dim, key)
    if cfg.kind == "patch_merger":
        return PatchMergerMLP(cfg, enc_dim, llm_dim, key)
    raise ValueError(f"ProjectorConfig.kind={cfg.kind!r}: use 'mlp', 'cross_attention' or "
                     f"'patch_merger'")
