"""Diffusion image generator (DistTrain's modality generator): a DiT-style denoiser.

Input: noisy patchified latents, the DDPM timestep, and the LLM's hidden states at the K
image-output query positions of the sample. Blocks: adaLN modulation from the timestep
embedding (DiT), self-attention over patches, cross-attention to the projected LLM states,
GELU MLP. Objective: epsilon prediction MSE under a linear-beta DDPM schedule. Modulation and
output layers are initialised small (not zero as in adaLN-Zero) so every weight has a
gradient from the first step, which the parity tests rely on.
`DiffusionGenerator(cfg, cond_dim, key, start, end)` holds blocks [start, end).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.attention import bam_attention, full_meta
from mmjax.models.config import GeneratorConfig
from mmjax.models.layers import Dense, LayerNorm, sinusoidal
from mmjax.models.scan import run_stack
from mmjax.models.layer_range import layer_range


def ddpm_alphas_cumprod(cfg: GeneratorConfig) -> np.ndarray:
    betas = np.linspace(cfg.beta_start, cfg.beta_end, cfg.num_train_timesteps, dtype=np.float64)
    return np.cumprod(1.0 - betas).astype(np.float32)


def add_noise(cfg: GeneratorConfig, latents, noise, t):
    """q(x_t | x_0): sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps. latents [G, P, pd], t [G]."""
    abar = jnp.asarray(ddpm_alphas_cumprod(cfg))[t][:, None, None]
    return jnp.sqrt(abar) * latents + jnp.sqrt(1.0 - abar) * noise


def grid_positions(cfg: GeneratorConfig):
    """Fixed 2-D sin-cos positions [P, hidden] for the latent patch grid."""
    side = cfg.latent_size // cfg.patch_size
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    half = cfg.hidden_size // 2
    return jnp.concatenate([sinusoidal(jnp.asarray(r.reshape(-1)), half),
                            sinusoidal(jnp.asarray(c.reshape(-1)), half)], axis=-1)


def _attend(qd, kd, vd, od, x, ctx, heads, attention_impl):
    """Unmasked attention of x's patches to ctx (itself or the LLM conditioning states)."""
    b, s, d = x.shape
    split = lambda a: a.reshape(*a.shape[:2], heads, d // heads)
    att = bam_attention(split(qd(x)), split(kd(ctx)), split(vd(ctx)), full_meta(b, s),
                        full_meta(b, ctx.shape[1]), implementation=attention_impl,
                        mask_family="full")
    return od(att.reshape(b, s, d))


class DiTBlock(nnx.Module):
    def __init__(self, key, cfg: GeneratorConfig):
        d, f = cfg.hidden_size, cfg.ffn_size
        ks = jax.random.split(key, 11)
        self.heads = cfg.num_heads
        self.modulation = Dense(ks[0], d, 6 * d, std=0.02)
        self.norm1 = LayerNorm(d, cfg.norm_eps, affine=False)
        self.q, self.k, self.v, self.o = (Dense(ks[i], d, d) for i in range(1, 5))
        self.ln_cross = LayerNorm(d, cfg.norm_eps)
        self.cq, self.ck, self.cv, self.co = (Dense(ks[i], d, d) for i in range(5, 9))
        self.norm2 = LayerNorm(d, cfg.norm_eps, affine=False)
        self.fc1, self.fc2 = Dense(ks[9], d, f), Dense(ks[10], f, d)

    def __call__(self, x, c, cond, attention_impl: str = "auto"):
        shift1, scale1, gate1, shift2, scale2, gate2 = jnp.split(
            self.modulation(jax.nn.silu(c))[:, None, :], 6, axis=-1)
        h = self.norm1(x) * (1 + scale1) + shift1
        x = x + gate1 * _attend(self.q, self.k, self.v, self.o, h, h, self.heads, attention_impl)
        x = x + _attend(self.cq, self.ck, self.cv, self.co, self.ln_cross(x), cond,
                        self.heads, attention_impl)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(jax.nn.gelu(self.fc1(h), approximate=True))


class DiffusionGenerator(nnx.Module):
    def __init__(self, cfg: GeneratorConfig, cond_dim: int, key, start: int = 0,
                 end: int | None = None):
        end, self.is_first, self.is_last = layer_range("generator block", cfg.num_layers, start, end)
        self.cfg, self.start, self.end = cfg, start, end
        k_in, k_blocks, k_out = (jax.random.fold_in(key, i) for i in range(3))
        d = cfg.hidden_size
        if self.is_first:
            ks = jax.random.split(k_in, 4)
            self.patch_embed = Dense(ks[0], cfg.patch_dim, d)
            self.t_fc1, self.t_fc2 = Dense(ks[1], 256, d), Dense(ks[2], d, d)
            self.cond_proj = Dense(ks[3], cond_dim, d)
        self.layers = nnx.List([DiTBlock(jax.random.fold_in(k_blocks, i), cfg)
                                for i in range(start, end)])
        if self.is_last:
            k1, k2 = jax.random.split(k_out)
            self.final_norm = LayerNorm(d, cfg.norm_eps, affine=False)
            self.final_modulation = Dense(k1, d, 2 * d, std=0.02)
            self.final_linear = Dense(k2, d, cfg.patch_dim, std=0.02)

    def embed(self, noisy, t, cond_hidden):
        """-> carry (x [G, P, d], c [G, d], cond [G, K, d])."""
        x = self.patch_embed(noisy) + grid_positions(self.cfg).astype(noisy.dtype)
        temb = sinusoidal(t, 256).astype(noisy.dtype)
        c = self.t_fc2(jax.nn.silu(self.t_fc1(temb)))
        return x, c, self.cond_proj(cond_hidden.astype(noisy.dtype))

    def run_layers(self, carry, attention_impl: str = "auto"):
        x, c, cond = carry
        x = run_stack(self.layers, x, lambda layer, h: layer(h, c, cond, attention_impl),
                      self.cfg.scan_layers, remat=self.cfg.remat)
        return x, c, cond

    def finish(self, carry):
        x, c, _ = carry
        shift, scale = jnp.split(self.final_modulation(jax.nn.silu(c))[:, None, :], 2, axis=-1)
        return self.final_linear(self.final_norm(x) * (1 + scale) + shift)

    def __call__(self, noisy, t, cond_hidden, attention_impl: str = "auto"):
        return self.finish(self.run_layers(self.embed(noisy, t, cond_hidden), attention_impl))


def diffusion_loss_sum(eps_pred, noise, valid):
    """Sum of squared epsilon error over valid images [G]; the caller divides by the global
    number of latent elements."""
    err = jnp.square(eps_pred.astype(jnp.float32) - noise.astype(jnp.float32))
    return jnp.sum(err * valid.astype(jnp.float32)[:, None, None])
