"""Image processors and the Whisper feature extractor, as Hugging Face defines them (no JAX).

`load_processor(path)` reads a `preprocessor_config.json` (the file or its directory) and
returns:
  - `ImageProcessor` for CLIP-style configs (`size: {"shortest_edge": s}`: the short side to
    s, the long side to int(s * long / short), then a centre crop to `crop_size`) and
    SigLIP-style ones (`size: {"height", "width"}`: a fixed-size resize), with `resample`
    (PIL filter id), `do_rescale` / `rescale_factor`, `do_normalize` / `image_mean` /
    `image_std`, `do_convert_rgb`. Called on a PIL image: float32 [3, H, W].
  - `NativeResizeProcessor` (`"image_processor_type": "NativeResize"`): the packed ViT's own
    native-aspect resize (each side to the nearest multiple of the patch size, 1..max_grid
    patches), so variable-size images stay variable.
  - `Qwen2VLImageProcessor` (`data/qwen2_vl_processor.py`; Qwen2-VL / Qwen2.5-VL's
    smart resize to multiples of 28 within min/max pixels).
  - `WhisperFeatureExtractor` (`feature_size` 80 / 128, `n_fft`, `hop_length`,
    `chunk_length` 30 s, `sampling_rate`): periodic Hann window, centred STFT with reflect
    padding, power spectrum, Slaney-scale Slaney-normalised mel filters, log10 with a 1e-10
    floor, the last frame dropped, clamped to max - 8.0, then (x + 4) / 4. Called on a 1-D
    waveform: float32 [n_mels, frames] (3000 frames: padded/truncated to 30 s by default).
Every processor also gives its output shape from the input's size alone (`output_size`,
`num_frames`), which is what the sidecar index and planning use.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from mmjax.data.image_ops import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PilImageOps
from mmjax.data.qwen2_vl_processor import Qwen2VLImageProcessor
from mmjax.errors import UserError



def _read_config(path: str) -> dict:
    file = os.path.join(path, "preprocessor_config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UserError(f"processor path {path!r}: no preprocessor_config.json (give the file "
                         f"or the directory of a Hugging Face model)")
    with open(file) as f:
        return json.load(f)


def load_processor(path: str):
    """The processor a Hugging Face `preprocessor_config.json` describes (module docstring)."""
    return processor_from_config(_read_config(path))


def processor_from_config(conf: dict):
    kind = conf.get("image_processor_type") or conf.get("feature_extractor_type") or ""
    if "Whisper" in kind or ("n_fft" in conf and "feature_size" in conf):
        return WhisperFeatureExtractor(**{k: conf[k] for k in WhisperFeatureExtractor.KEYS
                                          if k in conf})
    qwen = {"merge_size", "temporal_patch_size"} <= set(conf)
    if "Qwen2VL" in kind or "Qwen2_5_VL" in kind or qwen:
        return Qwen2VLImageProcessor(**{k: conf[k] for k in Qwen2VLImageProcessor.KEYS
                                        if k in conf})
    if kind == "NativeResize":
        return NativeResizeProcessor(**{k: conf[k] for k in NativeResizeProcessor.KEYS
                                        if k in conf})
    if "size" not in conf and "crop_size" not in conf:
        raise UserError(f"preprocessor_config.json of type {kind!r}: neither an image "
                         f"processor (size / crop_size) nor a Whisper feature extractor")
    return ImageProcessor(**{k: conf[k] for k in ImageProcessor.KEYS if k in conf})


def _size_dict(size) -> dict:
    """HF's get_size_dict: an int is a square (height = width), a dict stays."""
    if isinstance(size, int):
        return {"height": size, "width": size}
    if isinstance(size, (list, tuple)):
        return {"height": int(size[0]), "width": int(size[1])}
    return dict(size)


class ImageProcessor(PilImageOps):
    """CLIP / SigLIP image processor (see module docstring)."""

    KEYS = ("size", "crop_size", "do_resize", "do_center_crop", "resample", "do_rescale",
            "rescale_factor", "do_normalize", "image_mean", "image_std", "do_convert_rgb")

    def __init__(self, size=None, crop_size=None, do_resize=True, do_center_crop=None,
                 resample=3, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                 image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, do_convert_rgb=True):
        self.size = _size_dict(size if size is not None else {"shortest_edge": 224})
        self.crop_size = _size_dict(crop_size) if crop_size is not None else None
        self.do_center_crop = (self.crop_size is not None) if do_center_crop is None \
            else bool(do_center_crop)
        if self.do_center_crop and self.crop_size is None:
            raise UserError("preprocessor_config.json: do_center_crop without crop_size")
        if "shortest_edge" not in self.size and not {"height", "width"} <= set(self.size):
            raise UserError(f"preprocessor_config.json: size={self.size}: use "
                             f"{{'shortest_edge': s}} or {{'height': h, 'width': w}}")
        self.do_resize, self.resample = bool(do_resize), int(resample)
        self.do_rescale, self.rescale_factor = bool(do_rescale), float(rescale_factor)
        self.do_normalize = bool(do_normalize)
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.do_convert_rgb = bool(do_convert_rgb)

    def resize_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the resize step (HF get_resize_output_image_size)."""
        if not self.do_resize:
            return height, width
        if "shortest_edge" in self.size:
            s = int(self.size["shortest_edge"])
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = s, int(s * long / short)
            return (new_long, new_short) if width <= height else (new_short, new_long)
        return int(self.size["height"]), int(self.size["width"])

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """(H, W) of the processed image of an input of this size."""
        h, w = self.resize_size(height, width)
        if self.do_center_crop:
            return int(self.crop_size["height"]), int(self.crop_size["width"])
        return h, w

    def pixels(self, image) -> np.ndarray:
        image = self._prepare(image)
        h, w = self.resize_size(image.height, image.width)
        if self.do_resize:
            image = image.resize((w, h), resample=self.resample, reducing_gap=None)
        arr = np.asarray(image)
        if arr.ndim == 2:
            arr = arr[:, :, None]
        if self.do_center_crop:
            arr = center_crop(arr, int(self.crop_size["height"]), int(self.crop_size["width"]))
        return arr


def center_crop(arr: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """HF center_crop on [H, W, C]: top = (H - ch) // 2; zero-pads an image smaller than
    the crop (offset ceil((new - old) / 2))."""
    h, w = arr.shape[:2]
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return arr[top:top + ch, left:left + cw]
    nh, nw = max(ch, h), max(cw, w)
    out = np.zeros((nh, nw) + arr.shape[2:], arr.dtype)
    tp, lp = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    out[tp:tp + h, lp:lp + w] = arr
    top, left = top + tp, left + lp
    return out[max(0, top):min(nh, top + ch), max(0, left):min(nw, left + cw)]


class NativeResizeProcessor(PilImageOps):
    """Native-aspect resize for the packed (NaViT-style) ViT: each side to the nearest
    multiple of `patch_size`, between 1 and `max_grid` patches."""

    KEYS = ("patch_size", "max_grid", "resample", "do_rescale", "rescale_factor",
            "do_normalize", "image_mean", "image_std", "do_convert_rgb")

    def __init__(self, patch_size: int = 14, max_grid: int = 64, resample: int = 3,
                 do_rescale=True, rescale_factor=1 / 255, do_normalize=False,
                 image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), do_convert_rgb=True):
        self.patch_size, self.max_grid, self.resample = int(patch_size), int(max_grid), int(resample)
        self.do_rescale, self.rescale_factor = bool(do_rescale), float(rescale_factor)
        self.do_normalize = bool(do_normalize)
        self.image_mean, self.image_std = list(image_mean), list(image_std)
        self.do_convert_rgb = bool(do_convert_rgb)

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        p = self.patch_size
        fit = lambda x: int(np.clip(round(x / p), 1, self.max_grid)) * p
        return fit(height), fit(width)

    def pixels(self, image) -> np.ndarray:
        return self._at_output_size(image)


# ---------------------------------------------------------------------------------------
# Whisper
# ---------------------------------------------------------------------------------------

def hertz_to_mel_slaney(freq):
    """Slaney mel scale: linear below 1 kHz (3 mel per 200 Hz), log above."""
    freq = np.asarray(freq, np.float64)
    mels = 3.0 * freq / 200.0
    logstep = 27.0 / np.log(6.4)
    return np.where(freq >= 1000.0, 15.0 + np.log(np.maximum(freq, 1e-12) / 1000.0) * logstep,
                    mels)


def mel_to_hertz_slaney(mels):
    mels = np.asarray(mels, np.float64)
    freq = 200.0 * mels / 3.0
    logstep = np.log(6.4) / 27.0
    return np.where(mels >= 15.0, 1000.0 * np.exp(logstep * (mels - 15.0)), freq)


def mel_filter_bank(num_frequency_bins: int, num_mel_filters: int, min_frequency: float,
                    max_frequency: float, sampling_rate: int) -> np.ndarray:
    """[num_frequency_bins, num_mel_filters] triangular filters, Slaney scale, Slaney norm
    (HF audio_utils.mel_filter_bank(..., norm="slaney", mel_scale="slaney"))."""
    mels = np.linspace(hertz_to_mel_slaney(min_frequency), hertz_to_mel_slaney(max_frequency),
                       num_mel_filters + 2)
    filter_freqs = mel_to_hertz_slaney(mels)
    fft_freqs = np.linspace(0, sampling_rate // 2, num_frequency_bins)
    diff = np.diff(filter_freqs)
    slopes = filter_freqs[None, :] - fft_freqs[:, None]
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    enorm = 2.0 / (filter_freqs[2:num_mel_filters + 2] - filter_freqs[:num_mel_filters])
    return filters * enorm[None, :]


class WhisperFeatureExtractor:
    """Log-mel features as Whisper computes them (see module docstring)."""

    KEYS = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft",
            "padding_value", "do_normalize")

    def __init__(self, feature_size: int = 80, sampling_rate: int = 16000,
                 hop_length: int = 160, chunk_length: int = 30, n_fft: int = 400,
                 padding_value: float = 0.0, do_normalize: bool = False):
        self.feature_size, self.sampling_rate = int(feature_size), int(sampling_rate)
        self.hop_length, self.chunk_length, self.n_fft = int(hop_length), int(chunk_length), int(n_fft)
        self.padding_value, self.do_normalize = float(padding_value), bool(do_normalize)
        self.n_samples = self.chunk_length * self.sampling_rate
        self.mel_filters = mel_filter_bank(1 + self.n_fft // 2, self.feature_size, 0.0, 8000.0,
                                           self.sampling_rate)
        self.window = np.hanning(self.n_fft + 1)[:-1]  # periodic Hann

    def num_frames(self, num_samples: int, padding: str = "max_length") -> int:
        """Frames of the features of a waveform of `num_samples` samples."""
        n = self.n_samples if padding == "max_length" else min(int(num_samples), self.n_samples)
        return n // self.hop_length

    def log_mel(self, waveform: np.ndarray) -> np.ndarray:
        """float64 [n_mels, frames] log-mel of a (padded) waveform."""
        x = np.pad(np.asarray(waveform, np.float64), self.n_fft // 2, mode="reflect")
        n_frames = 1 + (x.size - self.n_fft) // self.hop_length
        idx = np.arange(self.n_fft)[None, :] + self.hop_length * np.arange(n_frames)[:, None]
        spec = np.abs(np.fft.rfft(x[idx] * self.window, axis=-1)) ** 2  # [frames, bins]
        mel = np.maximum(1e-10, self.mel_filters.T @ spec.T)
        log_spec = np.log10(mel)[:, :-1]
        log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
        return (log_spec + 4.0) / 4.0

    def __call__(self, waveform, sampling_rate: int | None = None, padding: str = "max_length",
                 truncation: bool = True) -> np.ndarray:
        """float32 [n_mels, frames]; `padding="max_length"` pads to `chunk_length` seconds
        (Whisper), "longest" keeps the clip's own length."""
        if sampling_rate is not None and sampling_rate != self.sampling_rate:
            raise ValueError(f"audio sampled at {sampling_rate} Hz; the feature extractor "
                             f"expects {self.sampling_rate} Hz (resample it first)")
        if padding not in ("max_length", "longest"):
            raise ValueError(f"padding={padding!r}: use 'max_length' or 'longest'")
        x = np.asarray(waveform, np.float32)
        if x.ndim != 1:
            raise ValueError(f"waveform must be 1-D, got shape {x.shape}")
        if truncation:
            x = x[:self.n_samples]
        n = x.size
        if padding == "max_length" and n < self.n_samples:
            x = np.concatenate([x, np.full(self.n_samples - n, self.padding_value, np.float32)])
        if self.do_normalize:  # zero mean, unit variance over the real samples
            mean, var = x[:n].mean(), x[:n].var()
            x = (x - mean) / np.sqrt(var + 1e-7)
            x[n:] = self.padding_value
        return self.log_mel(x).astype(np.float32)


def load_audio(path: str, sampling_rate: int) -> np.ndarray:
    """Mono float32 waveform at `sampling_rate` from a WAV / FLAC / OGG file (soundfile),
    resampled polyphase when the file's rate differs."""
    import soundfile as sf

    data, sr = sf.read(path, dtype="float32", always_2d=True)
    wave = data.mean(axis=1)
    if sr != sampling_rate:
        from scipy.signal import resample_poly

        g = math.gcd(int(sr), int(sampling_rate))
        wave = resample_poly(wave, sampling_rate // g, sr // g).astype(np.float32)
    return wave


def audio_num_samples(path: str, sampling_rate: int) -> int:
    """Samples `load_audio` returns, from the file header alone."""
    import soundfile as sf

    info = sf.info(path)
    if info.samplerate == sampling_rate:
        return int(info.frames)
    g = math.gcd(int(info.samplerate), int(sampling_rate))
    return -(-int(info.frames) * (sampling_rate // g) // (info.samplerate // g))
