#!/usr/bin/env python
"""Train the generation example's tiny VAE on the example's own pictures and write it:

  python scripts/make_example_vae.py [--steps 1500] [--out mmjax/data/example_vae_weights]

The example (`scripts/make_example_data.py`, configs/examples/llava_gen_tiny.gin) asks the
generator for 16 x 16 pictures: coloured squares, stripes and dots on a noisy grey ground
(`mmjax/data/example_data.py` `_picture`), encoded by a diffusers AutoencoderKL of
`example_vae.TINY_CONFIG`'s shape (8 and 16 channels, 4 x 8 x 8 latents). A VAE with random
weights decodes any latent to noise, so generated images mean nothing; this one is trained
(reconstruction + a small KL term, Adam, a fixed seed) on fresh pictures of every colour and
shape, cropped and resized as the data path does (`train/vae_latents.py` `square_pixels`),
and its `scaling_factor` set to 1 / the latents' standard deviation (Stable Diffusion's
convention: unit-variance latents for the DiT). The directory it writes (config.json +
diffusion_pytorch_model.safetensors, about 100 KB) is committed; `make_example_data.py`
copies it to OUT/vae/.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def pictures(n: int, side: int, seed: int) -> np.ndarray:
    """n example pictures of every colour and shape, as the data path feeds the VAE:
    float32 [n, side, side, 3] in [-1, 1]."""
    from PIL import Image

    from mmjax.data.example_data import COLOURS, SHAPES, _picture
    from mmjax.train.vae_latents import square_pixels

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        colour, shape = list(COLOURS)[i % len(COLOURS)], SHAPES[(i // len(COLOURS)) % 3]
        h, w = (32, 32) if i % 2 else tuple(int(x) for x in rng.integers(16, 72, size=2))
        out.append(square_pixels(Image.fromarray(_picture(rng, h, w, colour, shape)), side))
    return np.stack(out)


def train(steps: int, seed: int, batch: int = 32, lr: float = 2e-3, kl: float = 1e-4):
    """-> (trained AutoencoderKL, its VAEConfig with the fitted scaling_factor, final
    reconstruction error (mean absolute, pixels in [-1, 1]) on held-out pictures)."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from mmjax.data.example_vae import TINY_CONFIG
    from mmjax.models.hf.vae import vae_config_from_hf
    from mmjax.models.vae import AutoencoderKL

    cfg = vae_config_from_hf(TINY_CONFIG)
    side = TINY_CONFIG["sample_size"]
    data, held = pictures(1024, side, seed), pictures(64, side, seed + 1)
    model = AutoencoderKL(cfg, jax.random.key(seed))
    graphdef, params = nnx.split(model)
    tx = optax.adam(optax.cosine_decay_schedule(lr, steps, 0.05))
    opt = tx.init(params)

    def loss_fn(p, x, key):
        vae = nnx.merge(graphdef, p)
        mean, logvar = vae.encode(x)
        z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
        rec = jnp.mean(jnp.square(vae.decode(z) - x))
        return rec + kl * jnp.mean(jnp.square(mean) + jnp.exp(logvar) - 1.0 - logvar)

    @jax.jit
    def step(p, o, x, key):
        loss, g = jax.value_and_grad(loss_fn)(p, x, key)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    rng = np.random.default_rng(seed)
    for i in range(steps):
        x = data[rng.integers(0, len(data), batch)]
        params, opt, loss = step(params, opt, x, jax.random.key(i))
        if i % 250 == 0 or i == steps - 1:
            print(f"step {i}: loss {float(loss):.4f}")
    vae = nnx.merge(graphdef, params)
    mean, _ = jax.jit(vae.encode)(data)
    cfg = dataclasses.replace(cfg, scaling_factor=float(1.0 / np.std(np.asarray(mean))))
    err = float(jnp.mean(jnp.abs(jax.jit(lambda x: vae.decode(vae.encode(x)[0]))(held) - held)))
    return vae, cfg, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "mmjax", "data", "example_vae_weights"))
    a = ap.parse_args(argv)
    from mmjax.models.hf.vae import export_vae_safetensors

    vae, cfg, err = train(a.steps, a.seed)
    export_vae_safetensors(vae, cfg, a.out)
    print(f"wrote {a.out} (scaling_factor {cfg.scaling_factor:.4f}; held-out reconstruction "
          f"error {err:.4f} mean absolute on [-1, 1] pixels)")
    return 0


if __name__ == "__main__":
    from mmjax.cli import run_main

    sys.exit(run_main(main))
