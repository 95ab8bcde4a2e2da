"""Per-sample sizes the planner costs against (no JAX).

DistTrain's manager "randomly samples a subset of training data to analyze the data
distribution" (DistTrain §3); a `Workload` is that subset reduced to sizes: LLM tokens per
sample, and per encoder the token count of every modality subsequence (image patches;
audio tokens after the stride-2 conv, i.e. ceil(frames / 2)). The encoder cost of a sample
sums a linear and a quadratic (attention) term over its subsequences, so the skew of the
size distribution enters the cost (DistTrain §2.3).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Workload:
    name: str
    llm_tokens: tuple[int, ...]  # per sample
    encoder_tokens: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    generated: tuple[int, ...] = ()  # per sample: images the generator denoises
    cond_tokens: int = 64  # LLM hidden states conditioning one generated image

    @property
    def num_samples(self) -> int:
        return len(self.llm_tokens)

    @functools.cached_property
    def _moments(self) -> dict:
        """The moments read so far, by unit (the workload is immutable; a planning call
        reads each many times)."""
        return {}

    def llm_moments(self) -> tuple[float, float]:
        """Mean over samples of (tokens, tokens^2)."""
        key = ("llm_tokens",)  # by the field read, like the encoders' below
        if key not in self._moments:
            t = np.asarray(self.llm_tokens, dtype=np.float64)
            self._moments[key] = float(t.mean()), float((t * t).mean())
        return self._moments[key]

    def encoder_moments(self, unit: str) -> tuple[float, float]:
        """Mean over samples of (sum_i n_i, sum_i n_i^2) over the sample's subsequences."""
        per = self.encoder_tokens.get(unit)
        if not per:
            raise ValueError(f"workload {self.name!r} has no sizes for encoder {unit!r}; "
                             f"it has {sorted(self.encoder_tokens)}: build it for this model")
        key = ("encoder", unit)
        if key not in self._moments:
            sizes = np.fromiter(itertools.chain.from_iterable(per), dtype=np.float64)
            self._moments[key] = (float(sizes.sum() / len(per)),
                                  float((sizes * sizes).sum() / len(per)))
        return self._moments[key]

    def mean_segments(self, unit: str) -> float:
        """Mean number of subsequences (images, clips) of `unit` per sample."""
        counts: list[float] = [len(x) for x in self.encoder_tokens.get(unit, ())]
        return float(np.mean(counts or [0.0]))

    def mean_generated(self) -> float:
        return float(np.mean(self.generated)) if self.generated else 0.0


def patches(h: int, w: int, patch: int) -> int:
    return (h // patch) * (w // patch)


def audio_tokens(frames: int) -> int:
    """Whisper conv front end: stride 2 (3000 frames = 30 s -> 1500 tokens)."""
    return math.ceil(frames / 2)


def laion_like(model, num_samples: int = 512, seed: int = 0, seq_len: int = 8192) -> Workload:
    """DistTrain §2.3/§8: 8K fixed-length (padded) sequences of interleaved text and images;
    skewed image count per sample and skewed resolution. A quarter of the images are
    generation targets (the generator's work)."""
    rng = np.random.default_rng(seed)
    spec = model.encoders[0]
    p, ds = spec.encoder.patch_size, spec.projector.downsample
    sides = [224, 336, 448, 512, 768, 1024]
    # `rng.choice(sides, p=probs)` drawn as it draws it (one uniform, searched in the
    # normalised CDF): the same stream, without choice()'s per-call checks
    cdf = np.array([0.32, 0.25, 0.18, 0.12, 0.08, 0.05]).cumsum()
    cdf /= cdf[-1]
    side_patches = [patches(s, s, p) for s in sides]
    enc, gen = [], []
    for _ in range(num_samples):
        k = min(8, int(rng.geometric(0.45)))
        imgs, budget = [], seq_len // 2
        for _ in range(k):
            n = side_patches[int(cdf.searchsorted(rng.random(), side="right"))]
            if n // ds > budget:
                break
            budget -= n // ds
            imgs.append(n)
        imgs = imgs or [patches(224, 224, p)]
        enc.append(tuple(imgs))
        gen.append(int(rng.binomial(len(imgs), 0.25)) if model.generator else 0)
    return Workload("laion_like", (seq_len,) * num_samples, {spec.name: tuple(enc)},
                    tuple(gen) if model.generator else ())


def orchmllm_like(model, num_samples: int = 512, seed: int = 0, max_side: int = 448) -> Workload:
    """OrchMLLM §3.1/§8: a mix of image tasks (LLaVA-style, dynamic resolution up to
    `max_side`), ASR (LibriSpeech) and spoken QA; packed, so LLM tokens vary per sample
    (modality composition incoherence)."""
    rng = np.random.default_rng(seed)
    specs = {e.name: e for e in model.encoders}
    enc: dict[str, list[tuple[int, ...]]] = {name: [] for name in specs}
    llm = []
    for _ in range(num_samples):
        kind = rng.choice(3, p=[0.5, 0.3, 0.2])
        text = int(rng.integers(50, 600)) if kind != 1 else int(rng.integers(10, 80))
        total = text
        for name, spec in specs.items():
            sizes: tuple[int, ...] = ()
            if spec.modality == "image" and kind == 0:
                h, w = (int(rng.integers(224, max_side + 1)) for _ in range(2))
                sizes = (patches(h, w, spec.encoder.patch_size),)
            if spec.modality == "audio" and kind != 0:
                secs = rng.uniform(5, 30) if kind == 1 else rng.uniform(3, 15)
                sizes = (audio_tokens(int(secs * 100)),)
            enc[name].append(sizes)
            total += sum(s // spec.projector.downsample for s in sizes)
        llm.append(total)
    return Workload("orchmllm_like", tuple(llm), {k: tuple(v) for k, v in enc.items()})


def cornstarch_like(model, num_samples: int = 24) -> Workload:
    """Cornstarch §6.1: 1k text tokens, one 1280x720 image and a 30-s clip per sample,
    1.5k-4k LLM tokens in total; the image is taken at 672x378 (48x27 patches of 14) so the
    totals land in that range."""
    enc: dict[str, tuple[tuple[int, ...], ...]] = {}
    total = 1000
    for spec in model.encoders:
        n = (patches(672, 378, spec.encoder.patch_size) if spec.modality == "image"
             else audio_tokens(3000))
        enc[spec.name] = ((n,),) * num_samples
        total += n // spec.projector.downsample
    return Workload("cornstarch_like", (total,) * num_samples, enc)


def workload_from_metas(name: str, metas, model, cond_tokens: int = 64) -> Workload:
    """The workload of real samples (`data.sample.SampleMeta`s: shapes only, no pixels):
    LLM tokens per sample, per encoder the encoder tokens of each of the sample's
    subsequences of its modality, and the images it generates (DistTrain §3: the manager
    samples the training data to analyse its distribution)."""
    if not metas:
        raise ValueError(f"workload {name!r}: no samples; sample at least one")
    enc = {spec.name: tuple(tuple(s.num_encoder_tokens for s in m.segments
                                  if s.modality == spec.modality) for m in metas)
           for spec in model.encoders}
    return Workload(name, tuple(m.llm_length for m in metas), enc,
                    tuple(m.count("image_out") for m in metas), cond_tokens)


def default_workload(model, num_samples: int = 512, seed: int = 0) -> Workload:
    """The paper's dataset for the model family named by `model.name`."""
    family = model.name.split("/")[0]
    if family == "orchmllm":
        side = {"mllm_10b": 448, "mllm_18b": 672, "mllm_84b": 896}.get(
            model.name.split("/")[-1], 448)
        return orchmllm_like(model, num_samples, seed, side)
    if family == "cornstarch":
        return cornstarch_like(model)
    if not model.encoders:
        return Workload("text_only", (8192,) * num_samples)
    if len(model.encoders) > 1:
        return orchmllm_like(model, num_samples, seed)
    return laion_like(model, num_samples, seed)
