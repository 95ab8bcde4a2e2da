"""The generator's targets from images: a frozen VAE encodes each `output_image` to latents,
either in the data path (placement "host": the host's or a producer's CPU) or as a frozen
unit of the model on its own devices (placement "device": the data path hands the pixels on
and the `vae` unit, models/units.py, encodes them in the step), so the DiT trains on real
latents.

`vae.path` (gin) names a diffusers AutoencoderKL directory (config.json +
diffusion_pytorch_model.safetensors, e.g. Stable Diffusion 2.1's `vae/`). Target images are
centre-cropped to a square and resized (bicubic) to `latent_size x vae downsample` pixels,
scaled to [-1, 1], and encoded to the posterior mode times `scaling_factor`
(`AutoencoderKL.latents`), as [C, h, w] float32 (the `image_out` segment's layout).
`LatentEncoder` is what a data source calls; it pickles to its settings alone (grain
workers and producer processes load the VAE themselves, on their CPU). With the VAE as a
unit it returns the pixels [3, side, side] (`GenSlot.pixel_side`) and loads no VAE.
"""
from __future__ import annotations

import gin
import numpy as np

from mmjax.errors import UserError
from mmjax.models.config import MLLMConfig
from mmjax.planner.vae_placement import VAEPlacement
from mmjax.settings import bound


def square_pixels(image, side: int) -> np.ndarray:
    """PIL image -> float32 [side, side, 3] in [-1, 1]: centre square crop, bicubic resize."""
    from PIL import Image

    im = image.convert("RGB")
    w, h = im.size
    s = min(w, h)
    left, top = (w - s) // 2, (h - s) // 2
    im = im.crop((left, top, left + s, top + s)).resize((side, side), Image.Resampling.BICUBIC)
    return np.asarray(im, np.float32) / 127.5 - 1.0


class LatentEncoder:
    """PIL image -> latents float32 [C, h, w] through the VAE at `path` (on this process's
    CPU; placement "host"), or -> its pixels [3, side, side] for the VAE unit (placement
    "device"). `latent_shape`, `num_queries`: the generator's; `data_shape`: what the
    `image_out` segment carries."""

    def __init__(self, path: str, latent_shape: tuple[int, int, int], num_queries: int,
                 placement: str = "host"):
        from mmjax.models.hf.vae import vae_config_from_hf

        try:
            self.vae_cfg = vae_config_from_hf(path)
        except (FileNotFoundError, UserError, ValueError) as e:
            raise UserError(f"vae.path={path!r}: {e}") from None
        c, h, w = latent_shape
        if self.vae_cfg.latent_channels != c:
            raise UserError(f"vae.path: the VAE has {self.vae_cfg.latent_channels} latent "
                            f"channels but the generator's latent_channels is {c}; set "
                            f"generator.latent_channels={self.vae_cfg.latent_channels}")
        if placement not in ("host", "device"):
            raise UserError(f"vae.placement={placement!r}: use 'auto', 'host' or 'device'")
        self.path, self.latent_shape, self.num_queries = path, (c, h, w), num_queries
        self.placement = placement  # host: this process's CPU; device: the VAE unit's devices
        self.side = h * self.vae_cfg.downsample  # the pixels the VAE reads
        self.decision = None  # the planner's VAEPlacement when placement was "auto"
        self._fn = None

    @property
    def data_shape(self) -> tuple[int, int, int]:
        return (3, self.side, self.side) if self.placement == "device" else self.latent_shape

    def __getstate__(self):
        return {**self.__dict__, "_fn": None}

    def _encode_fn(self):
        if self._fn is None:
            import jax
            from flax import nnx

            from mmjax.models.hf.vae import load_vae_safetensors

            dev = jax.devices("cpu")[0]
            with jax.default_device(dev):
                vae, _ = load_vae_safetensors(self.path)
                graphdef, state = nnx.split(vae)
                state = jax.device_put(state, dev)
            fn = jax.jit(lambda st, x: nnx.merge(graphdef, st).latents(x))
            self._fn = lambda x: fn(state, jax.device_put(x, dev))
        return self._fn

    def pixels(self, image) -> np.ndarray:
        return square_pixels(image, self.side)

    def __call__(self, image) -> np.ndarray:
        if self.placement == "device":  # the VAE unit encodes them on its devices
            return np.ascontiguousarray(self.pixels(image).transpose(2, 0, 1))
        lat = np.asarray(self._encode_fn()(self.pixels(image)[None]))[0]
        return np.ascontiguousarray(lat.transpose(2, 0, 1), np.float32)


@gin.configurable
def vae(path: str | None = None, placement: str = "auto", hardware: str = "h100",
        step_time_s: float = 0.0):
    """`vae.path`: the frozen VAE of the generator's data path (None: no output images);
    `placement`: "host" (CPU of the process that decodes: the trainer's data thread or the
    producers), "device" (a frozen `vae` unit of the model: its own sub-mesh in a plan,
    part of the single program; the data path ships pixels), "auto" (the planner's cost
    comparison, planner/vae_placement.py, with the step time it may hide behind)."""
    return path, placement, hardware, step_time_s


def resolve_placement(cfg, side: int, placement: str, hardware: str, step_time_s: float,
                      producers: int, images_per_step: int, backend: str):
    """-> (placement, VAEPlacement or None): "auto" resolved by the planner's cost model
    (host on a CPU backend: no accelerator to place the unit on)."""
    from mmjax.planner.hardware import hardware as hardware_by_name
    from mmjax.planner.vae_placement import (PLACEMENTS, choose_vae_placement,
                                             vae_encoder_flops)

    if placement not in PLACEMENTS:
        raise UserError(f"vae.placement={placement!r}: use one of {list(PLACEMENTS)}")
    if placement != "auto":
        return placement, None
    decision = choose_vae_placement(
        images_per_step, vae_encoder_flops(cfg.block_out_channels, cfg.layers_per_block,
                                           cfg.in_channels, cfg.latent_channels, side,
                                           cfg.mid_block_add_attention),
        side, hardware_by_name(hardware), max(producers, 1), step_time_s,
        channel_width=max(cfg.block_out_channels))
    if backend == "cpu":  # no accelerator: the unit would compete with the CPU step
        return "host", decision
    return decision.placement, decision


def _encoder(cfg: MLLMConfig, path: str, num_queries: int, placement: str) -> LatentEncoder:
    if cfg.generator is None:
        raise UserError("vae.path is set but the model has no generator: drop vae.path or "
                        "use a model with a generator (e.g. named_model_config.name='tiny')")
    g = cfg.generator
    return LatentEncoder(path, (g.latent_channels, g.latent_size, g.latent_size), num_queries,
                         placement)


def place_vae(cfg: MLLMConfig) -> tuple[MLLMConfig, str | None, VAEPlacement | None]:
    """The run's VAE placement (gin `vae.*`), decided once before the plan is made:
    -> (cfg, the VAE directory when it is a unit, the planner's decision for "auto").
    "device" makes the VAE a frozen unit of the model (`cfg.vae`: the plan gives it its own
    devices, the single program runs it inside its step); "host" leaves `cfg` as it is."""
    import jax

    path, placement, hw, step_time_s = vae()
    if not path:
        return cfg, None, None
    enc = _encoder(cfg, path, 1, "host")
    producers = int(bound("Loader.producers", 0)) + len(bound("Loader.producer_addresses", ()))
    where, decision = resolve_placement(
        enc.vae_cfg, enc.side, placement, hw, step_time_s, producers,
        int(bound("train.global_batch", 8)), jax.default_backend())
    if where == "host":
        return cfg.replace(vae=None), None, decision
    return cfg.replace(vae=enc.vae_cfg), path, decision


def output_image_encoder(cfg: MLLMConfig, num_queries: int) -> LatentEncoder | None:
    """The configured `LatentEncoder` for `cfg`'s generator, or None without `vae.path`:
    pixels for the model's VAE unit when `cfg.vae` is set (`place_vae`), else latents."""
    path = vae()[0]
    if not path:
        return None
    return _encoder(cfg, path, num_queries, "device" if cfg.vae is not None else "host")
