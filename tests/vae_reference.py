"""Float64 numpy reference of diffusers' AutoencoderKL, straight from its tensor names (NCHW,
as PyTorch computes it), and a writer of random tiny checkpoints in diffusers' layout.
Written from diffusers' `Encoder` / `Decoder` / `ResnetBlock2D` / `Attention` /
`Downsample2D` / `Upsample2D` forward passes, independently of mmjax.models.vae. The random
checkpoints come from mmjax/data/example_vae.py (names and shapes only)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def conv(x, w, b, stride=1, pad=None):
    """torch Conv2d, x [B, C, H, W], w [O, C, k, k]; pad: int or (top, bottom, left, right)."""
    k = w.shape[-1]
    pad = k // 2 if pad is None else pad
    t, bo, l, r = (pad,) * 4 if isinstance(pad, int) else pad
    x = np.pad(x, ((0, 0), (0, 0), (t, bo), (l, r)))
    win = sliding_window_view(x, (k, k), axis=(2, 3))[:, :, ::stride, ::stride]
    return np.einsum("bchwij,ocij->bohw", win, w) + b[None, :, None, None]


def group_norm(x, g, w, b, eps=1e-6):
    B, C, H, W = x.shape
    y = x.reshape(B, g, -1)
    y = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + eps)
    return y.reshape(B, C, H, W) * w[None, :, None, None] + b[None, :, None, None]


def silu(x):
    return x / (1.0 + np.exp(-x))


class Ref:
    def __init__(self, tensors: dict, config: dict):
        self.t = {k: np.asarray(v, np.float64) for k, v in tensors.items()}
        self.c = config
        self.g = config["norm_num_groups"]

    def conv(self, name, x, **kw):
        return conv(x, self.t[name + ".weight"], self.t[name + ".bias"], **kw)

    def norm(self, name, x):
        return group_norm(x, self.g, self.t[name + ".weight"], self.t[name + ".bias"])

    def resnet(self, p, x):
        h = self.conv(p + ".conv1", silu(self.norm(p + ".norm1", x)))
        h = self.conv(p + ".conv2", silu(self.norm(p + ".norm2", h)))
        sc = self.conv(p + ".conv_shortcut", x) if p + ".conv_shortcut.weight" in self.t else x
        return sc + h

    def linear(self, name, x):
        return x @ self.t[name + ".weight"].T + self.t[name + ".bias"]

    def attention(self, p, x):
        B, C, H, W = x.shape
        h = self.norm(p + ".group_norm", x).reshape(B, C, H * W).transpose(0, 2, 1)
        q, k, v = (self.linear(f"{p}.{n}", h) for n in ("to_q", "to_k", "to_v"))
        s = q @ k.transpose(0, 2, 1) / np.sqrt(C)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ v
        o = self.linear(p + ".to_out.0", o)
        return x + o.transpose(0, 2, 1).reshape(B, C, H, W)

    def mid(self, p, x):
        x = self.resnet(p + ".resnets.0", x)
        if p + ".attentions.0.to_q.weight" in self.t:
            x = self.attention(p + ".attentions.0", x)
        return self.resnet(p + ".resnets.1", x)

    def encode(self, images_nchw):
        """-> (mean, logvar) NCHW."""
        n, lpb = len(self.c["block_out_channels"]), self.c["layers_per_block"]
        x = self.conv("encoder.conv_in", images_nchw)
        for i in range(n):
            for j in range(lpb):
                x = self.resnet(f"encoder.down_blocks.{i}.resnets.{j}", x)
            if i < n - 1:
                x = self.conv(f"encoder.down_blocks.{i}.downsamplers.0.conv", x, stride=2,
                              pad=(0, 1, 0, 1))
        x = self.mid("encoder.mid_block", x)
        x = self.conv("encoder.conv_out", silu(self.norm("encoder.conv_norm_out", x)))
        x = self.conv("quant_conv", x)
        lat = self.c["latent_channels"]
        return x[:, :lat], np.clip(x[:, lat:], -30.0, 20.0)

    def decode(self, z_nchw):
        n, lpb = len(self.c["block_out_channels"]), self.c["layers_per_block"]
        x = self.conv("post_quant_conv", z_nchw)
        x = self.mid("decoder.mid_block", self.conv("decoder.conv_in", x))
        for i in range(n):
            for j in range(lpb + 1):
                x = self.resnet(f"decoder.up_blocks.{i}.resnets.{j}", x)
            if i < n - 1:
                x = x.repeat(2, axis=2).repeat(2, axis=3)
                x = self.conv(f"decoder.up_blocks.{i}.upsamplers.0.conv", x)
        return self.conv("decoder.conv_out", silu(self.norm("decoder.conv_norm_out", x)))



from mmjax.data.example_vae import TINY_CONFIG, tiny_tensors, write_tiny_vae  # noqa: E402,F401
