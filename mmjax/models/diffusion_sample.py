"""Sampling latents from the DiT (`models/generator.py`): DDPM ancestral steps or DDIM.

The generator is trained on epsilon prediction under a linear-beta DDPM schedule
(`ddpm_alphas_cumprod`). Sampling walks `steps` evenly spaced timesteps from T-1 down to 0:
- "ddim" (Song et al., DDIM, eq. 12 with eta = 0): x0 = (x_t - sqrt(1-a_t) eps) / sqrt(a_t),
  x_prev = sqrt(a_prev) x0 + sqrt(1-a_prev) eps; deterministic given the start noise;
- "ddpm" (Ho et al., DDPM, the posterior q(x_prev | x_t, x0) with x0 from eps): mean
  (sqrt(a_prev) b_t x0 + sqrt(alpha_t) (1 - a_prev) x_t) / (1 - a_t), variance
  (1 - a_prev) / (1 - a_t) b_t, where alpha_t = a_t / a_prev and b_t = 1 - alpha_t (the
  strided schedule of improved DDPM when steps < T); no noise at the last step.
`eps_fn(x_t, t)` is the denoiser (the DiT conditioned on the LLM's states); latents are
patchified [G, P, patch_dim] as the generator reads them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mmjax.models.config import GeneratorConfig
from mmjax.models.generator import ddpm_alphas_cumprod

SAMPLERS = ("ddim", "ddpm")


def timesteps(cfg: GeneratorConfig, steps: int) -> np.ndarray:
    """`steps` timesteps from T-1 down to 0, evenly spaced (int32)."""
    if not 1 <= steps <= cfg.num_train_timesteps:
        raise ValueError(f"steps={steps}: use 1 ..{cfg.num_train_timesteps}")
    return np.round(np.linspace(cfg.num_train_timesteps - 1, 0, steps)).astype(np.int32)


def sample_latents(cfg: GeneratorConfig, eps_fn, shape, key, steps: int = 50,
                   sampler: str = "ddim"):
    """Start from N(0, I) of `shape` [G, P, patch_dim] and denoise; -> x_0 estimate."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r}: use one of {SAMPLERS}")
    abar = ddpm_alphas_cumprod(cfg).astype(np.float64)
    ts = timesteps(cfg, steps)
    k0, key = jax.random.split(key)
    x = jax.random.normal(k0, shape, jnp.float32)
    for i, t in enumerate(ts):
        a_t = abar[t]
        a_prev = abar[ts[i + 1]] if i + 1 < len(ts) else 1.0
        eps = eps_fn(x, jnp.full((shape[0],), t, jnp.int32)).astype(jnp.float32)
        x0 = (x - np.sqrt(1 - a_t) * eps) / np.sqrt(a_t)
        if sampler == "ddim" or i + 1 == len(ts):
            x = np.sqrt(a_prev) * x0 + np.sqrt(1 - a_prev) * eps if i + 1 < len(ts) else x0
            continue
        alpha = a_t / a_prev
        beta = 1 - alpha
        mean = (np.sqrt(a_prev) * beta * x0 + np.sqrt(alpha) * (1 - a_prev) * x) / (1 - a_t)
        var = (1 - a_prev) / (1 - a_t) * beta
        key, k = jax.random.split(key)
        x = mean + np.sqrt(var) * jax.random.normal(k, shape, jnp.float32)
    return x


def unpatchify(patches, side: int, p: int, channels: int):
    """[G, (side/p)^2, p*p*C] -> [G, side, side, C] (inverse of data/assemble.py patchify)."""
    g, n = patches.shape[0], side // p
    x = patches.reshape(g, n, n, p, p, channels).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(g, side, side, channels)
