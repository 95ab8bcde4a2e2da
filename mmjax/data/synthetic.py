"""Seeded synthetic multimodal datasets with the skew the papers measure (no JAX).

`laion_like`: image-text samples as in DistTrain's LAION-400M characterisation (DistTrain
§2.3, Fig. 5): right-skewed text subsequence lengths (log-normal), right-skewed image sizes
(log-normal side lengths in patches, varied aspect ratios) and a skewed count of images per
sample (geometric: one image is most common, a long tail has many).

`orchmllm_mix`: OrchMLLM's instruction mix (OrchMLLM §3.1, §8 "Datasets"): image tasks
(LLaVA-style caption/VQA), ASR (transcript length strongly correlated with the audio
length), spoken QA (audio question, short answer uncorrelated with it) and optionally
text-to-image generation (an `image_out` segment). Modalities are absent from whole tasks,
so the vision/audio share of a sample varies wildly: modality composition incoherence.

Everything is deterministic per (seed, index): a sample's *shapes* come from one RNG stream
(`spec`, cheap, what planning needs) and its arrays from a second one (`sample`), so any host
can produce any sample, or only its shapes. `bad_fraction` injects empty, undecodable and
too-long samples for testing the loader's skip path.
"""
from __future__ import annotations

from dataclasses import dataclass

import math
from typing import Any

import numpy as np

from mmjax.errors import UserError
from mmjax.data.seed_states import pcg64_state, seed_states
from mmjax.data.sample import FIRST_TEXT_ID, Sample, SampleMeta, Segment, TokenRules
from mmjax.models.config import MLLMConfig, VisionConfig

Spec = list[tuple[str, tuple[int, ...], int]]  # (modality, shape, num_queries) per segment
KINDS = ("laion", "mix")
# LLaVA-like shapes (`SyntheticConfig` overrides of kind "laion"): one or two images of ~24 x
# 24 patches, a few hundred text tokens (~1.1k LLM tokens a sample with patch-14 tokens);
# scripts/bench_step.py's llava_1b data, scripts/bench_packing.py's "llava" mix
LLAVA_LIKE = {"image_side_median": 24.0, "image_side_sigma": 0.2, "image_side_range": (8, 32),
              "max_images": 2, "image_count_p": 0.8, "text_len_median": 200.0,
              "text_len_range": (16, 1024)}


@dataclass(frozen=True)
class SyntheticConfig:
    """Sizes kept small by default so CPU tests stay fast; raise them for benchmarks."""

    vocab_size: int = 512
    patch_size: int = 14
    image_side_median: float = 4.0  # in patches
    image_side_sigma: float = 0.5
    image_side_range: tuple[int, int] = (1, 16)  # in patches
    max_images: int = 6
    image_count_p: float = 0.55  # geometric parameter of the image count
    text_len_median: float = 20.0
    text_len_sigma: float = 0.8
    text_len_range: tuple[int, int] = (1, 256)
    n_mels: int = 16
    frames_median: float = 96.0
    frames_sigma: float = 0.6
    frames_range: tuple[int, int] = (8, 1000)
    latent_shape: tuple[int, int, int] = (4, 8, 8)  # image_out's shape: latents (or pixels
    #                                                 [3, side, side] for a VAE unit)
    gen_queries: int = 16
    gen_fraction: float = 0.0  # share of generation tasks in the mix
    bad_fraction: float = 0.0  # share of deliberately bad samples
    too_long_tokens: int = 1 << 15

    @classmethod
    def for_model(cls, cfg: MLLMConfig, **kw) -> "SyntheticConfig":
        """Shapes that match `cfg` (vocab, patch size, mel bins, latent shape)."""
        base: dict[str, Any] = {"vocab_size": cfg.llm.vocab_size}
        for spec in cfg.encoders:
            if isinstance(spec.encoder, VisionConfig):
                # Qwen2-VL: sides in units of patch * merge (its processor's multiple)
                unit = spec.encoder.spatial_merge_size if spec.encoder.kind == "qwen2_vl" else 1
                base["patch_size"] = spec.encoder.patch_size * unit
                base["image_side_range"] = (1, min(16, spec.encoder.max_grid // unit))
            else:
                base["n_mels"] = spec.encoder.num_mel_bins
        if cfg.generator is not None:
            g = cfg.generator
            base["latent_shape"] = (g.latent_channels, g.latent_size, g.latent_size)
            if cfg.vae is not None:  # the VAE is a unit: image_out segments hold pixels
                side = g.latent_size * cfg.vae.downsample
                base["latent_shape"] = (3, side, side)
            base["gen_fraction"] = 0.15
        base.update(kw)
        return cls(**base)


def _lognormal_int(rng, median, sigma, lo, hi, size=None):
    if size is None:  # one value: plain floats (numpy's scalar calls cost ~10x as much)
        return _clip_round(median * math.exp(sigma * rng.standard_normal()), lo, hi)
    return np.clip(np.rint(median * np.exp(sigma * rng.standard_normal(size))), lo, hi).astype(int)


def _clip_round(x: float, lo: int, hi: int) -> int:
    """`int(np.clip(np.rint(x), lo, hi))` on a float (round half to even, as rint)."""
    return min(max(round(x), lo), hi)


def _text(cfg, rng, median=None, sigma=None):
    n = _lognormal_int(rng, median or cfg.text_len_median, sigma or cfg.text_len_sigma,
                       *cfg.text_len_range)
    return ("text", (int(n),), 0)


def _image(cfg, rng):
    side = _lognormal_int(rng, cfg.image_side_median, cfg.image_side_sigma,
                          *cfg.image_side_range)
    aspect = math.exp(0.35 * rng.standard_normal())
    h = _clip_round(side * aspect, *cfg.image_side_range)
    w = _clip_round(side / aspect, *cfg.image_side_range)
    return ("image", (h * cfg.patch_size, w * cfg.patch_size, 3), 0)


def _frames(cfg, rng):
    return int(_lognormal_int(rng, cfg.frames_median, cfg.frames_sigma, *cfg.frames_range))


def _bad(cfg, rng) -> Spec:
    kind = rng.integers(3)
    if kind == 0:
        return []  # empty
    if kind == 1:  # undecodable: image side not a multiple of the patch size
        return [("text", (4,), 0), ("image", (cfg.patch_size * 2 + 1, cfg.patch_size * 2, 3), 0)]
    return [("text", (cfg.too_long_tokens,), 0)]  # longer than any sequence


def laion_spec(cfg: SyntheticConfig, seed: int, index: int) -> Spec:
    """Interleaved text/image shapes of LAION-like sample `index` (DistTrain Fig. 5)."""
    return _laion(cfg, np.random.default_rng([seed, index, 0]))


def _laion(cfg: SyntheticConfig, rng) -> Spec:
    if rng.random() < cfg.bad_fraction:
        return _bad(cfg, rng)
    n_images = int(min(rng.geometric(cfg.image_count_p), cfg.max_images))
    spec: Spec = []
    for _ in range(n_images):
        if rng.random() < 0.7:
            spec.append(_text(cfg, rng))
        spec.append(_image(cfg, rng))
    spec.append(_text(cfg, rng))
    if cfg.gen_fraction and rng.random() < cfg.gen_fraction:
        # DistTrain's generation side: the text is a prompt for an image to generate.
        spec.append(("image_out", cfg.latent_shape, cfg.gen_queries))
    return spec


def mix_spec(cfg: SyntheticConfig, seed: int, index: int) -> Spec:
    """Shapes of OrchMLLM-mix sample `index` (OrchMLLM §3.1): one task per sample."""
    return _mix(cfg, np.random.default_rng([seed, index, 0]))


def _mix(cfg: SyntheticConfig, rng) -> Spec:
    if rng.random() < cfg.bad_fraction:
        return _bad(cfg, rng)
    u = rng.random()
    p_gen = cfg.gen_fraction
    p_img = (1 - p_gen) * 0.4
    p_asr = (1 - p_gen) * 0.3
    if u < p_gen:  # text-to-image generation: prompt -> image_out
        return [_text(cfg, rng, median=12), ("image_out", cfg.latent_shape, cfg.gen_queries)]
    if u < p_gen + p_img:  # caption / VQA: images, question, answer
        spec = [_image(cfg, rng) for _ in range(1 + int(rng.random() < 0.2))]
        return spec + [_text(cfg, rng, median=10), _text(cfg, rng)]
    if u < p_gen + p_img + p_asr:  # ASR: transcript length follows the audio length
        t = _frames(cfg, rng)
        words = _clip_round(t / 6 * math.exp(0.15 * rng.standard_normal()),
                            *cfg.text_len_range)
        return [("text", (4,), 0), ("audio", (t, cfg.n_mels), 0), ("text", (words,), 0)]
    # spoken QA: audio question, short answer independent of the audio length
    t = _frames(cfg, rng)
    return [("audio", (t, cfg.n_mels), 0), _text(cfg, rng, median=6, sigma=1.0)]


def fill(cfg: SyntheticConfig, spec: Spec, seed: int, index: int) -> Sample:
    """Real arrays for `spec` from sample `index`'s second RNG stream."""
    rng = np.random.default_rng([seed, index, 1])
    segs = []
    for mod, shape, k in spec:
        if mod == "text":
            # Zipf-like ids: frequent tokens dominate, as in natural text.
            ids = FIRST_TEXT_ID + (rng.zipf(1.3, size=shape) - 1) % (cfg.vocab_size - FIRST_TEXT_ID)
            segs.append(Segment("text", ids.astype(np.int32)))
        elif mod == "image":
            segs.append(Segment("image", rng.random(shape, dtype=np.float32)))
        elif mod == "audio":
            segs.append(Segment("audio", rng.standard_normal(shape, dtype=np.float32)))
        else:
            segs.append(Segment("image_out", rng.standard_normal(shape, dtype=np.float32), k))
    return Sample(index, tuple(segs))


class SyntheticDataset:
    """Random-access synthetic dataset of `size` samples (grain-compatible: len/getitem).

    `spec(i)` gives shapes without arrays; `meta(i, rules)` the planning metadata."""

    def __init__(self, kind: str, cfg: SyntheticConfig, seed: int = 0, size: int = 1 << 20):
        if kind not in KINDS:
            raise UserError(f"SyntheticDataset kind={kind!r}: use one of {KINDS}")
        self.kind, self.cfg, self.seed, self.size = kind, cfg, seed, size

    def __len__(self) -> int:
        return self.size

    def spec(self, index: int) -> Spec:
        f = laion_spec if self.kind == "laion" else mix_spec
        return f(self.cfg, self.seed, int(index))

    def specs(self, indices: np.ndarray) -> list[Spec]:
        """`spec(i)` of every i in `indices`: one generator whose state is set per sample
        (data/seed_states.py), not one built per sample (3x faster, the same draws)."""
        f = _laion if self.kind == "laion" else _mix
        bits = np.random.PCG64(0)
        rng = np.random.Generator(bits)
        out = []
        for words in seed_states(self.seed, indices, 0):
            # numpy's stubs want their private _PCG64State TypedDict; the dict has its keys
            bits.state = pcg64_state(words)  # type: ignore[assignment]
            out.append(f(self.cfg, rng))
        return out

    def meta(self, index: int, rules: TokenRules) -> SampleMeta:
        return rules.meta_from_shapes(int(index), self.spec(index))

    def __getitem__(self, index: int) -> Sample:
        index = int(index)
        if not 0 <= index < self.size:
            raise IndexError(f"index {index} outside dataset of {self.size}")
        return fill(self.cfg, self.spec(index), self.seed, index)


def laion_like(cfg: SyntheticConfig, seed: int, index: int) -> Sample:
    return fill(cfg, laion_spec(cfg, seed, index), seed, index)


def orchmllm_mix(cfg: SyntheticConfig, seed: int, index: int) -> Sample:
    return fill(cfg, mix_spec(cfg, seed, index), seed, index)
