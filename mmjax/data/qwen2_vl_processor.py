"""Qwen2-VL / Qwen2.5-VL image processor, as Hugging Face's `Qwen2VLImageProcessor` (no JAX).

`smart_resize`: each side to a multiple of patch_size * merge_size (28), the pixel count kept
within [min_pixels, max_pixels] (`size: {shortest_edge, longest_edge}` in transformers 5's
preprocessor_config.json, `min_pixels` / `max_pixels` in transformers 4's), aspect ratio
kept as closely as possible; PIL bicubic resize, rescale, normalise with the config's
mean / std (CLIP's by default). `patchify`: the image repeated `temporal_patch_size` times,
cut into p x p patches ordered merge block by merge block (the 2 x 2 patches a merged token
reads are consecutive), each flattened in (c, t, py, px) order: HF's `pixel_values` rows.
`preprocess(images)` gives HF's `pixel_values` [sum of patches, C*t*p*p] and
`image_grid_thw` [images, 3]; `__call__(image)` the resized, normalised float32 [3, H, W]
that the data path stores and `data/assemble.py` patchifies the same way.
"""
from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from typing import ClassVar

import numpy as np

from mmjax.data.image_ops import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PilImageOps
from mmjax.errors import UserError


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 56 * 56,
                 max_pixels: int = 14 * 14 * 4 * 1280) -> tuple[int, int]:
    """HF `smart_resize`: (height, width) multiples of `factor` with min_pixels <= h * w <=
    max_pixels, the aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {height}x{width}: aspect ratio over 200 (Qwen2-VL's limit)")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(image: np.ndarray, patch_size: int, merge_size: int,
             temporal_patch_size: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    """float32 [C, H, W] -> (patches [gh * gw, C*t*p*p] in HF's order, (1, gh, gw))."""
    c, h, w = image.shape
    p, m = patch_size, merge_size
    gh, gw = h // p, w // p
    x = np.asarray(image, np.float32).reshape(c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, c, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (temporal_patch_size,)
                        + x.shape[5:])
    return x.reshape(gh * gw, c * temporal_patch_size * p * p), (1, gh, gw)


@dataclass(eq=False)  # compared by identity, as a processor object
class Qwen2VLImageProcessor(PilImageOps):
    """HF Qwen2VLImageProcessor (module docstring): the fields of its
    preprocessor_config.json; `size` ({"shortest_edge", "longest_edge"}) sets the pixel
    bounds that `min_pixels` / `max_pixels` leave unset."""

    KEYS: ClassVar[tuple[str, ...]] = (
        "size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
        "resample", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
        "image_std", "do_convert_rgb")

    size: InitVar[dict | None] = None
    min_pixels: int | None = None
    max_pixels: int | None = None
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: list = field(default_factory=lambda: list(OPENAI_CLIP_MEAN))
    image_std: list = field(default_factory=lambda: list(OPENAI_CLIP_STD))
    do_convert_rgb: bool = True

    def __post_init__(self, size):
        size = dict(size or {})
        self.min_pixels = int(self.min_pixels if self.min_pixels is not None else
                              size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
        self.max_pixels = int(self.max_pixels if self.max_pixels is not None else
                              size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
        if not 0 < self.min_pixels <= self.max_pixels:
            raise UserError(f"preprocessor_config.json: min_pixels={self.min_pixels} / "
                            f"max_pixels={self.max_pixels}: use 0 < min_pixels <= max_pixels")
        self.patch_size, self.merge_size = int(self.patch_size), int(self.merge_size)
        self.temporal_patch_size = int(self.temporal_patch_size)
        self.do_resize, self.resample = bool(self.do_resize), int(self.resample)
        self.do_rescale, self.rescale_factor = bool(self.do_rescale), float(self.rescale_factor)
        self.do_normalize = bool(self.do_normalize)
        self.image_mean, self.image_std = list(self.image_mean), list(self.image_std)
        self.do_convert_rgb = bool(self.do_convert_rgb)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the processed image of an input of this size."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise ValueError(f"image {height}x{width} with do_resize false: sides must be "
                                 f"multiples of patch_size * merge_size = {self.factor}")
            return height, width
        lo, hi = self.min_pixels, self.max_pixels
        assert lo is not None and hi is not None  # set by __post_init__
        return smart_resize(height, width, self.factor, lo, hi)

    def pixels(self, image) -> np.ndarray:
        """PIL image / uint8 array -> uint8 [H, W, 3], resized."""
        return self._at_output_size(image)

    def patchify(self, image: np.ndarray):
        return patchify(image, self.patch_size, self.merge_size, self.temporal_patch_size)

    def preprocess(self, images) -> dict:
        """-> {"pixel_values": [patches, C*t*p*p], "image_grid_thw": int64 [images, 3]}."""
        out = [self.patchify(self(im)) for im in images]
        return {"pixel_values": np.concatenate([p for p, _ in out]),
                "image_grid_thw": np.array([g for _, g in out], np.int64)}
