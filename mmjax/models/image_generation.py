"""Image output from a trained MLLM: the LLM's states at the image-output query tokens
condition the DiT, which samples latents (DDPM / DDIM, `models/diffusion_sample.py`); the
frozen VAE decodes them to pixels. The conditioning is computed exactly as in training
(`MultimodalModel.__call__`: encoders -> LLM -> final hidden states at `gen_query`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mmjax.models.diffusion_sample import sample_latents, unpatchify
from mmjax.models.llm import meta_attend
from mmjax.models.mllm import encode, llm_embed, llm_meta, lm_outputs, unit_attention


def condition(model, batch, dtype=jnp.float32, attention_impl="auto",
              llm_mask_family: str = "bam"):
    """The LLM's final hidden states at the batch's generator query positions [G, K, d]."""
    cfg = model.cfg
    out = {e.name: encode(e, model.encoders[e.name], model.projectors[e.name],
                          batch["encoders"][e.name], dtype, unit_attention(attention_impl, e.name))
           for e in cfg.encoders if e.name in batch["encoders"]}
    x = llm_embed(cfg, model.llm, batch, out, dtype)
    attend = meta_attend(llm_meta(batch), unit_attention(attention_impl, "llm"), llm_mask_family)
    h = model.llm.run_layers(x, batch["positions"], attend)
    return lm_outputs(model.llm, h, batch, True)[1]


def generate_images(model, vae, batch, seed: int = 0, steps: int = 50, sampler: str = "ddim",
                    attention_impl="auto", llm_mask_family: str = "bam") -> np.ndarray:
    """-> uint8 [G, H, W, 3], one image per image-output segment of `batch`."""
    g = model.cfg.generator
    cond = nnx.jit(condition, static_argnames=("attention_impl", "llm_mask_family"))(
        model, batch, attention_impl=attention_impl, llm_mask_family=llm_mask_family)

    @nnx.jit
    def eps(gen, x, t, c):
        return gen(x, t, c)

    shape = (cond.shape[0], g.num_patches, g.patch_dim)
    x0 = sample_latents(g, lambda x, t: eps(model.generator, x, t, cond), shape,
                        jax.random.key(seed), steps, sampler)
    lat = unpatchify(x0, g.latent_size, g.patch_size, g.latent_channels)
    pixels = nnx.jit(lambda v, z: v.images(z))(vae, lat)
    return np.asarray(jnp.clip((pixels + 1.0) * 127.5, 0, 255).round().astype(jnp.uint8))
