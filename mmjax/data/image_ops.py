"""The image operations every image processor shares, as Hugging Face defines them (no
JAX): RGB conversion, then rescale and normalise with the CLIP mean and std by default.
preprocess.py and qwen2_vl_processor.py build their processors on `PilImageOps`."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def convert_to_rgb(image):
    """HF's `convert_to_rgb`: an image with transparency (an alpha band, or a palette /
    grey image with a transparency entry) is composited onto opaque white, then RGB; any
    other mode is converted directly."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


class PilImageOps(ABC):
    """Resize / rescale / normalise shared by the image processors (HF semantics)."""

    # set by each processor (preprocess.py, qwen2_vl_processor.py)
    do_convert_rgb: bool
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: Sequence[float]
    image_std: Sequence[float]
    output_size: Callable[[int, int], tuple[int, int]]  # (height, width) -> resized

    def _prepare(self, image):
        from PIL import Image

        if not isinstance(image, Image.Image):
            image = Image.fromarray(np.asarray(image))
        if self.do_convert_rgb and image.mode != "RGB":
            image = convert_to_rgb(image)
        return image

    def __call__(self, image) -> np.ndarray:
        """PIL image / uint8 array -> float32 [3, H, W], resized and normalised (HF's
        layout)."""
        return np.ascontiguousarray(self.channels_last(image).transpose(2, 0, 1))

    def channels_last(self, image) -> np.ndarray:
        """The same pixels as float32 [H, W, 3], contiguous (what the data sources keep),
        made without the [3, H, W] copy."""
        return self._scaled(self.pixels(image))

    @abstractmethod
    def pixels(self, image) -> np.ndarray:
        """The resized (and cropped) image, [H, W, C] before rescaling; each processor's."""

    def _at_output_size(self, image) -> np.ndarray:
        """PIL image / uint8 array -> uint8 [H, W, 3] at `output_size` (resized when it
        differs): the processors whose `pixels` is a plain resize."""
        image = self._prepare(image)
        h, w = self.output_size(image.height, image.width)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), resample=self.resample, reducing_gap=None)
        return np.asarray(image)

    def _scaled(self, arr: np.ndarray) -> np.ndarray:
        """[H, W, 3] -> float32 [H, W, 3], contiguous (rescale in float32, then normalise)."""
        x = arr
        if self.do_rescale:
            x = (x * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x.astype(np.float32) if not np.issubdtype(x.dtype, np.floating) else x
            mean = np.asarray(self.image_mean, dtype=x.dtype)
            std = np.asarray(self.image_std, dtype=x.dtype)
            x = (x - mean) / std
        return np.ascontiguousarray(x, np.float32)
