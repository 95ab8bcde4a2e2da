"""diffusers `AutoencoderKL` safetensors (Stable Diffusion's VAE) <-> `models.vae.AutoencoderKL`.

A diffusers VAE directory holds `config.json` (`_class_name: AutoencoderKL`, block sizes,
`scaling_factor`) and `diffusion_pytorch_model.safetensors`. Every tensor keeps its diffusers
name and layout (conv kernels [out, in, kh, kw]; Linear weights transposed to our [in, out]),
so the table below is the whole mapping. Checks (missing / unexpected tensors, shapes) run on
the headers before any weight is read. Older checkpoints name the mid-block attention
`query/key/value/proj_attn`; those are accepted under the current names.
"""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from flax import nnx

from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, apply_to_module, dense,
                                        module_pure, read_config, save_entries)
from mmjax.models.vae import AutoencoderKL, VAEConfig

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
_LEGACY = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def _conv(hf: str, path: tuple, cin: int, cout: int, k: int) -> list[Entry]:
    return [Entry(hf + ".weight", path + ("kernel",), (cout, cin, k, k)),
            Entry(hf + ".bias", path + ("bias",), (cout,))]


def _norm(hf: str, path: tuple, c: int) -> list[Entry]:
    return [Entry(hf + ".weight", path + ("scale",), (c,)),
            Entry(hf + ".bias", path + ("bias",), (c,))]


def _resnet(hf: str, path: tuple, cin: int, cout: int) -> list[Entry]:
    out = (_norm(hf + ".norm1", path + ("norm1",), cin)
           + _conv(hf + ".conv1", path + ("conv1",), cin, cout, 3)
           + _norm(hf + ".norm2", path + ("norm2",), cout)
           + _conv(hf + ".conv2", path + ("conv2",), cout, cout, 3))
    if cin != cout:
        out += _conv(hf + ".conv_shortcut", path + ("conv_shortcut",), cin, cout, 1)
    return out


def _mid(cfg: VAEConfig, hf: str, path: tuple, c: int) -> list[Entry]:
    out = _resnet(hf + ".resnets.0", path + ("resnets", 0), c, c)
    if cfg.mid_block_add_attention:
        a, ap = hf + ".attentions.0", path + ("attentions", 0)
        out += _norm(a + ".group_norm", ap + ("group_norm",), c)
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            out += dense(f"{a}.{name}", ap + (name.split(".")[0],), c, c)
    return out + _resnet(hf + ".resnets.1", path + ("resnets", 1), c, c)


def vae_entries(cfg: VAEConfig) -> list[Entry]:
    """diffusers names for every parameter of `AutoencoderKL(cfg)`."""
    ch, n, lat = cfg.block_out_channels, len(cfg.block_out_channels), cfg.latent_channels
    out = _conv("encoder.conv_in", ("encoder", "conv_in"), cfg.in_channels, ch[0], 3)
    for i in range(n):
        p, q = f"encoder.down_blocks.{i}", ("encoder", "down_blocks", i)
        for j in range(cfg.layers_per_block):
            cin = ch[max(i - 1, 0)] if j == 0 else ch[i]
            out += _resnet(f"{p}.resnets.{j}", q + ("resnets", j), cin, ch[i])
        if i < n - 1:
            out += _conv(f"{p}.downsamplers.0.conv", q + ("downsamplers", 0, "conv"),
                         ch[i], ch[i], 3)
    out += _mid(cfg, "encoder.mid_block", ("encoder", "mid_block"), ch[-1])
    out += _norm("encoder.conv_norm_out", ("encoder", "conv_norm_out"), ch[-1])
    out += _conv("encoder.conv_out", ("encoder", "conv_out"), ch[-1], 2 * lat, 3)
    if cfg.use_quant_conv:
        out += _conv("quant_conv", ("quant_conv",), 2 * lat, 2 * lat, 1)
    if cfg.use_post_quant_conv:
        out += _conv("post_quant_conv", ("post_quant_conv",), lat, lat, 1)
    rch = ch[::-1]
    out += _conv("decoder.conv_in", ("decoder", "conv_in"), lat, rch[0], 3)
    out += _mid(cfg, "decoder.mid_block", ("decoder", "mid_block"), rch[0])
    for i in range(n):
        p, q = f"decoder.up_blocks.{i}", ("decoder", "up_blocks", i)
        for j in range(cfg.layers_per_block + 1):
            cin = rch[max(i - 1, 0)] if j == 0 else rch[i]
            out += _resnet(f"{p}.resnets.{j}", q + ("resnets", j), cin, rch[i])
        if i < n - 1:
            out += _conv(f"{p}.upsamplers.0.conv", q + ("upsamplers", 0, "conv"),
                         rch[i], rch[i], 3)
    out += _norm("decoder.conv_norm_out", ("decoder", "conv_norm_out"), ch[0])
    out += _conv("decoder.conv_out", ("decoder", "conv_out"), ch[0], cfg.out_channels, 3)
    return out


def vae_config_from_hf(config) -> VAEConfig:
    """diffusers AutoencoderKL config.json (path, directory or dict) -> VAEConfig."""
    c = read_config(config)
    if c.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise ValueError(f"config.json _class_name={c.get('_class_name')!r}: expected "
                         f"'AutoencoderKL' (a diffusers VAE directory, e.g. SD 2.1's vae/)")
    if c.get("act_fn", "silu") != "silu":
        raise ValueError(f"config.json act_fn={c['act_fn']!r}: mmjax's VAE uses 'silu'")
    for key, want in (("down_block_types", "DownEncoderBlock2D"),
                      ("up_block_types", "UpDecoderBlock2D")):
        bad = [t for t in c.get(key, []) if t != want]
        if bad:
            raise ValueError(f"config.json {key} has {bad[0]!r}: only {want} is modelled")
    ch = tuple(c.get("block_out_channels", (64,)))
    return VAEConfig(
        in_channels=c.get("in_channels", 3), out_channels=c.get("out_channels", 3),
        block_out_channels=ch, layers_per_block=c.get("layers_per_block", 1),
        latent_channels=c.get("latent_channels", 4), norm_num_groups=c.get("norm_num_groups", 32),
        scaling_factor=float(c.get("scaling_factor", 0.18215)),
        shift_factor=float(c.get("shift_factor") or 0.0),
        sample_size=c.get("sample_size", 32),
        mid_block_add_attention=bool(c.get("mid_block_add_attention", True)),
        use_quant_conv=bool(c.get("use_quant_conv", True)),
        use_post_quant_conv=bool(c.get("use_post_quant_conv", True)))


def vae_config_to_hf(cfg: VAEConfig) -> dict:
    n = len(cfg.block_out_channels)
    return {"_class_name": "AutoencoderKL", "act_fn": "silu",
            "block_out_channels": list(cfg.block_out_channels),
            "down_block_types": ["DownEncoderBlock2D"] * n,
            "up_block_types": ["UpDecoderBlock2D"] * n, "in_channels": cfg.in_channels,
            "out_channels": cfg.out_channels, "latent_channels": cfg.latent_channels,
            "layers_per_block": cfg.layers_per_block, "norm_num_groups": cfg.norm_num_groups,
            "sample_size": cfg.sample_size, "scaling_factor": cfg.scaling_factor,
            "shift_factor": cfg.shift_factor or None,
            "mid_block_add_attention": cfg.mid_block_add_attention,
            "use_quant_conv": cfg.use_quant_conv,
            "use_post_quant_conv": cfg.use_post_quant_conv}


def _weights(path: Path):
    """The safetensors of a diffusers VAE directory (or a file given directly)."""
    if path.is_dir() and (path / WEIGHTS_NAME).exists():
        return path / WEIGHTS_NAME
    return path


def _legacy_names(ckpt: Checkpoint, entries: list[Entry]) -> list[Entry]:
    """Entries renamed to the checkpoint's pre-0.14 attention names where it uses them."""
    out = []
    for e in entries:
        for new, old in _LEGACY.items():
            if f".attentions.0.{new}." in e.hf and e.hf not in ckpt.file:
                alt = e.hf.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
                if alt in ckpt.file:
                    e = Entry(alt, e.path, e.shape, e.transpose)
        out.append(e)
    return out


def load_vae_safetensors(path, cfg: VAEConfig | None = None):
    """diffusers VAE directory (config.json + diffusion_pytorch_model.safetensors) ->
    (AutoencoderKL in float32: it is frozen and small, VAEConfig); missing / unexpected tensors or wrong shapes raise one
    ValueError naming the tensor before any weight is read."""
    path = Path(path)
    cfg = cfg or vae_config_from_hf(path if path.is_dir() else path.parent)
    ckpt = Checkpoint(_weights(path))
    entries = _legacy_names(ckpt, vae_entries(cfg))
    known = {e.hf for e in entries}
    pure = LoadPlan(ckpt, entries, known, f"VAE {path}").read(np.float32)
    module = nnx.eval_shape(lambda: AutoencoderKL(cfg, jax.random.key(0)))
    return apply_to_module(module, pure), cfg


def export_vae_safetensors(module_or_pure, cfg: VAEConfig, out_dir) -> list[Path]:
    """Write a diffusers VAE directory (config.json + diffusion_pytorch_model.safetensors)."""
    import json
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(vae_config_to_hf(cfg), indent=2))
    return save_entries(module_pure(module_or_pure), vae_entries(cfg), out / WEIGHTS_NAME,
                        "VAE")
