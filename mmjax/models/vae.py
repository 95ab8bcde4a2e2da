"""Frozen image autoencoder for the generator's data path: Stable Diffusion's `AutoencoderKL`.

DistTrain's modality generator learns in the latent space of a frozen VAE: target images are
encoded to latents (the posterior's mean, times `scaling_factor`) which the DiT learns to
denoise, and sampled latents are decoded back to pixels. This is diffusers' AutoencoderKL
(the Stable Diffusion 2.1 VAE layout) as a pure NNX module, so its safetensors load unchanged
(`models/hf/vae.py`): encoder conv_in -> down blocks (ResNet blocks, a stride-2 conv with
diffusers' (0, 1, 0, 1) zero pad after every block but the last) -> mid block (ResNet,
single-head self-attention, ResNet) -> GroupNorm, SiLU, conv_out (2 x latent channels) ->
quant_conv; the decoder mirrors it with nearest-neighbour 2x upsampling.

Images are NHWC in [-1, 1]; latents NHWC. Conv kernels are kept in PyTorch's [out, in, kh, kw]
layout (the convolution reads them as "OIHW"), so import is a plain copy. Arithmetic runs in
float32 whatever the parameter dtype (GroupNorm statistics and softmax as diffusers upcasts).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mmjax.models.config import VAEConfig  # noqa: F401  (re-exported: its home is config.py)
from mmjax.models.layers import Dense, ones, param, zeros


class _Keys:
    """Fresh keys for random init (tests, shapes); real weights come from a checkpoint."""

    def __init__(self, key):
        self.key, self.i = key, 0

    def __call__(self):
        self.i += 1
        return jax.random.fold_in(self.key, self.i)


class Conv2d(nnx.Module):
    """PyTorch Conv2d: kernel [out, in, k, k], symmetric padding `pad` or explicit pairs."""

    def __init__(self, keys, cin: int, cout: int, k: int, stride: int = 1, pad=None):
        self.kernel = param(keys(), (cout, cin, k, k), 1.0 / math.sqrt(cin * k * k))
        self.bias = zeros((cout,))
        self.stride = stride
        p = (k // 2) if pad is None else pad
        self.padding = ((p, p), (p, p)) if isinstance(p, int) else tuple(map(tuple, p))

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(
            x, self.kernel[...].astype(x.dtype), (self.stride, self.stride), self.padding,
            dimension_numbers=("NHWC", "OIHW", "NHWC"), precision=jax.lax.Precision.HIGHEST)
        return y + self.bias[...].astype(x.dtype)


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm over NHWC: per sample and group of channels, biased variance."""

    def __init__(self, groups: int, channels: int, eps: float):
        self.groups, self.eps = groups, eps
        self.scale, self.bias = ones((channels,)), zeros((channels,))

    def __call__(self, x):
        b, h, w, c = x.shape
        g = x.astype(jnp.float32).reshape(b, h, w, self.groups, c // self.groups)
        mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
        var = jnp.mean(jnp.square(g - mean), axis=(1, 2, 4), keepdims=True)
        y = ((g - mean) * jax.lax.rsqrt(var + self.eps)).reshape(b, h, w, c)
        return (y * self.scale[...] + self.bias[...]).astype(x.dtype)


class ResnetBlock(nnx.Module):
    """diffusers ResnetBlock2D without time embedding: GN-SiLU-conv twice + (1x1) shortcut."""

    def __init__(self, keys, cfg: VAEConfig, cin: int, cout: int):
        g, eps = cfg.norm_num_groups, cfg.norm_eps
        self.norm1, self.conv1 = GroupNorm(g, cin, eps), Conv2d(keys, cin, cout, 3)
        self.norm2, self.conv2 = GroupNorm(g, cout, eps), Conv2d(keys, cout, cout, 3)
        self.conv_shortcut = Conv2d(keys, cin, cout, 1) if cin != cout else None

    def __call__(self, x):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class AttnBlock(nnx.Module):
    """The mid block's attention (diffusers `Attention`, one head of all channels):
    GroupNorm, q/k/v over the H*W positions, softmax(q k^T / sqrt(C)) v, to_out, residual."""

    def __init__(self, keys, cfg: VAEConfig, c: int):
        self.group_norm = GroupNorm(cfg.norm_num_groups, c, cfg.norm_eps)
        self.to_q, self.to_k, self.to_v, self.to_out = (Dense(keys(), c, c) for _ in range(4))

    def __call__(self, x):
        b, h, w, c = x.shape
        t = self.group_norm(x).reshape(b, h * w, c)
        q, k, v = self.to_q(t), self.to_k(t), self.to_v(t)
        s = jnp.einsum("bqc,bkc->bqk", q, k, precision=jax.lax.Precision.HIGHEST) / math.sqrt(c)
        p = jax.nn.softmax(s.astype(jnp.float32), axis=-1).astype(x.dtype)
        o = jnp.einsum("bqk,bkc->bqc", p, v, precision=jax.lax.Precision.HIGHEST)
        return x + self.to_out(o).reshape(b, h, w, c)


class MidBlock(nnx.Module):
    def __init__(self, keys, cfg: VAEConfig, c: int):
        self.resnets = nnx.List([ResnetBlock(keys, cfg, c, c), ResnetBlock(keys, cfg, c, c)])
        self.attentions = nnx.List([AttnBlock(keys, cfg, c)] if cfg.mid_block_add_attention
                                   else [])

    def __call__(self, x):
        x = self.resnets[0](x)
        for a in self.attentions:
            x = a(x)
        return self.resnets[1](x)


class Sampler(nnx.Module):
    """diffusers Downsample2D (3x3 stride-2 conv after a (0, 1, 0, 1) zero pad) or
    Upsample2D (nearest 2x, then 3x3 conv); held as `downsamplers.0` / `upsamplers.0`."""

    def __init__(self, keys, c: int, down: bool):
        self.down = down
        self.conv = Conv2d(keys, c, c, 3, stride=2, pad=((0, 1), (0, 1))) if down else \
            Conv2d(keys, c, c, 3)

    def __call__(self, x):
        if not self.down:
            x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x)


class Block(nnx.Module):
    """DownEncoderBlock2D / UpDecoderBlock2D: ResNet blocks, then an optional resampler."""

    def __init__(self, keys, cfg: VAEConfig, cin: int, cout: int, n: int, sample: str | None):
        self.resnets = nnx.List([ResnetBlock(keys, cfg, cin if j == 0 else cout, cout)
                                 for j in range(n)])
        self.sample = sample
        if sample == "down":
            self.downsamplers = nnx.List([Sampler(keys, cout, True)])
        elif sample == "up":
            self.upsamplers = nnx.List([Sampler(keys, cout, False)])

    def __call__(self, x):
        for r in self.resnets:
            x = r(x)
        if self.sample == "down":
            x = self.downsamplers[0](x)
        elif self.sample == "up":
            x = self.upsamplers[0](x)
        return x


class Encoder(nnx.Module):
    def __init__(self, keys, cfg: VAEConfig):
        ch, n = cfg.block_out_channels, len(cfg.block_out_channels)
        self.conv_in = Conv2d(keys, cfg.in_channels, ch[0], 3)
        self.down_blocks = nnx.List([
            Block(keys, cfg, ch[max(i - 1, 0)], ch[i], cfg.layers_per_block,
                  "down" if i < n - 1 else None) for i in range(n)])
        self.mid_block = MidBlock(keys, cfg, ch[-1])
        self.conv_norm_out = GroupNorm(cfg.norm_num_groups, ch[-1], cfg.norm_eps)
        self.conv_out = Conv2d(keys, ch[-1], 2 * cfg.latent_channels, 3)

    def __call__(self, x):
        x = self.conv_in(x)
        for b in self.down_blocks:
            x = b(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(self.mid_block(x))))


class Decoder(nnx.Module):
    def __init__(self, keys, cfg: VAEConfig):
        ch, n = cfg.block_out_channels[::-1], len(cfg.block_out_channels)
        self.conv_in = Conv2d(keys, cfg.latent_channels, ch[0], 3)
        self.mid_block = MidBlock(keys, cfg, ch[0])
        self.up_blocks = nnx.List([
            Block(keys, cfg, ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1,
                  "up" if i < n - 1 else None) for i in range(n)])
        self.conv_norm_out = GroupNorm(cfg.norm_num_groups, ch[-1], cfg.norm_eps)
        self.conv_out = Conv2d(keys, ch[-1], cfg.out_channels, 3)

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for b in self.up_blocks:
            x = b(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class AutoencoderKL(nnx.Module):
    """encode: images [B, H, W, in] -> (mean, logvar) [B, H/f, W/f, latent] (logvar clipped
    to [-30, 20] as diffusers' DiagonalGaussianDistribution); decode: latents -> images.
    `latents` / `images` add the scaling (and shift) factor the generator trains with."""

    def __init__(self, cfg: VAEConfig, key):
        keys = _Keys(key)
        self.cfg = cfg
        self.encoder = Encoder(keys, cfg)
        self.decoder = Decoder(keys, cfg)
        c2 = 2 * cfg.latent_channels
        self.quant_conv = Conv2d(keys, c2, c2, 1) if cfg.use_quant_conv else None
        self.post_quant_conv = (Conv2d(keys, cfg.latent_channels, cfg.latent_channels, 1)
                                if cfg.use_post_quant_conv else None)

    def encode(self, images):
        h = self.encoder(images.astype(jnp.float32))
        if self.quant_conv is not None:
            h = self.quant_conv(h)
        mean, logvar = jnp.split(h, 2, axis=-1)
        return mean, jnp.clip(logvar, -30.0, 20.0)

    def decode(self, z):
        z = z.astype(jnp.float32)
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def latents(self, images):
        """The generator's training target: (posterior mode - shift) * scaling_factor."""
        mean, _ = self.encode(images)
        return (mean - self.cfg.shift_factor) * self.cfg.scaling_factor

    def images(self, latents):
        """Inverse of `latents` through the decoder; images in [-1, 1] (not clipped)."""
        return self.decode(latents / self.cfg.scaling_factor + self.cfg.shift_factor)


def patchified_latents(vae: AutoencoderKL, pixels, patch_size: int):
    """Target pixels [G, H, W, 3] in [-1, 1] -> the generator's training latents, patchified
    as data/assemble.py `patchify` does on the host ([G, (h/p)(w/p), p*p*C], float32): the
    VAE unit's output when the planner places the VAE on devices."""
    lat = vae.latents(pixels)
    g, h, w, c = lat.shape
    p = patch_size
    x = lat.reshape(g, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(g, (h // p) * (w // p), p * p * c)
