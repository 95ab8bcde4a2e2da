"""A tiny random diffusers AutoencoderKL directory (numpy + safetensors, no JAX, no torch):
the example data's VAE (scripts/make_example_data.py) and the tests' fixture. Tensor names
and shapes are diffusers' (conv weights [out, in, k, k], Linear weights [out, in])."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TINY_CONFIG = {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [8, 16],
               "down_block_types": ["DownEncoderBlock2D"] * 2,
               "up_block_types": ["UpDecoderBlock2D"] * 2, "in_channels": 3, "out_channels": 3,
               "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 4,
               "sample_size": 16, "scaling_factor": 0.18215}


def tiny_tensors(config: dict, seed: int = 0) -> dict:
    """Random diffusers-named tensors for `config` (shapes as diffusers creates them)."""
    rng = np.random.default_rng(seed)
    t: dict = {}

    def conv_(name, cin, cout, k):
        t[name + ".weight"] = rng.normal(0, 1 / np.sqrt(cin * k * k), (cout, cin, k, k))
        t[name + ".bias"] = rng.normal(0, 0.1, (cout,))

    def norm_(name, c):
        t[name + ".weight"] = 1 + rng.normal(0, 0.1, (c,))
        t[name + ".bias"] = rng.normal(0, 0.1, (c,))

    def resnet_(p, cin, cout):
        norm_(p + ".norm1", cin), conv_(p + ".conv1", cin, cout, 3)
        norm_(p + ".norm2", cout), conv_(p + ".conv2", cout, cout, 3)
        if cin != cout:
            conv_(p + ".conv_shortcut", cin, cout, 1)

    def mid_(p, c):
        resnet_(p + ".resnets.0", c, c)
        norm_(p + ".attentions.0.group_norm", c)
        for n in ("to_q", "to_k", "to_v", "to_out.0"):
            t[f"{p}.attentions.0.{n}.weight"] = rng.normal(0, 1 / np.sqrt(c), (c, c))
            t[f"{p}.attentions.0.{n}.bias"] = rng.normal(0, 0.1, (c,))
        resnet_(p + ".resnets.1", c, c)

    ch, lpb, lat = config["block_out_channels"], config["layers_per_block"], config["latent_channels"]
    n = len(ch)
    conv_("encoder.conv_in", config["in_channels"], ch[0], 3)
    for i in range(n):
        for j in range(lpb):
            resnet_(f"encoder.down_blocks.{i}.resnets.{j}", ch[max(i - 1, 0)] if j == 0 else ch[i],
                    ch[i])
        if i < n - 1:
            conv_(f"encoder.down_blocks.{i}.downsamplers.0.conv", ch[i], ch[i], 3)
    mid_("encoder.mid_block", ch[-1])
    norm_("encoder.conv_norm_out", ch[-1])
    conv_("encoder.conv_out", ch[-1], 2 * lat, 3)
    conv_("quant_conv", 2 * lat, 2 * lat, 1)
    conv_("post_quant_conv", lat, lat, 1)
    r = ch[::-1]
    conv_("decoder.conv_in", lat, r[0], 3)
    mid_("decoder.mid_block", r[0])
    for i in range(n):
        for j in range(lpb + 1):
            resnet_(f"decoder.up_blocks.{i}.resnets.{j}", r[max(i - 1, 0)] if j == 0 else r[i], r[i])
        if i < n - 1:
            conv_(f"decoder.up_blocks.{i}.upsamplers.0.conv", r[i], r[i], 3)
    norm_("decoder.conv_norm_out", ch[0])
    conv_("decoder.conv_out", ch[0], config["out_channels"], 3)
    return t


def write_tiny_vae(out_dir, config: dict = TINY_CONFIG, seed: int = 0, drop: str | None = None):
    """A diffusers VAE directory with random float32 weights; `drop` leaves one tensor out.
    -> the float64 tensors written (before the float32 cast)."""
    from safetensors.numpy import save_file
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t = tiny_tensors(config, seed)
    t = {k: v.astype(np.float32).astype(np.float64) for k, v in t.items()}
    save_file({k: v.astype(np.float32) for k, v in t.items() if k != drop},
              str(out / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return t
