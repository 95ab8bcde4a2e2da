"""Training samples and their metadata (no JAX).

A `Sample` is one training example: an ordered list of interleaved modality subsequences
(DistTrain §2.3: "each input sequence consists of interleaved modality subsequences").
A `SampleMeta` is what planning needs: per subsequence its modality, how many LLM tokens it
becomes and how many encoder tokens it costs. It is computed from array *shapes* only, so
every host can compute the metadata of a whole global batch cheaply and make the same plan
(OrchMLLM §7 "a structure recording the counts of subsequences ... and the order in which
they are interleaved", gathered for the global orchestrator).

Token-count rules (`TokenRules`, built from an `MLLMConfig`), one exact rule per modality:
  image  H x W x 3, patch p: n = (H/p)(W/p) encoder tokens (patches);
         mlp projector with downsample r: ceil(n / r) LLM tokens (the image's patch run is
         padded to a multiple of r in its buffer, so a group never straddles two images);
         cross-attention projector: num_queries LLM tokens.
  audio  T frames: the Whisper front end (conv k3 stride 1, then conv k3 stride 2, pad 1)
         gives ceil(T / 2) encoder tokens; mlp with downsample r: ceil(ceil(T/2) / r) LLM
         tokens; cross-attention: num_queries.
  image_out  latent C x h x w: K LLM query tokens (K carried by the segment); the
         generator's cost is its (h/p_g)(w/p_g) latent patches.
  text   L tokens: L LLM tokens, no encoder cost.
In the LLM sequence every document is `bos ... eos` and every modality block is wrapped in
its start/end special tokens (see `assemble.py`), so `SampleMeta.llm_length` counts those.
"""
from __future__ import annotations

from typing import Any


import math
from dataclasses import dataclass, field

import numpy as np

from mmjax.models.config import MLLMConfig, VisionConfig

MODALITIES = ("text", "image", "audio", "image_out")

# Reserved token ids (text ids start at FIRST_TEXT_ID).
PAD, BOS, EOS = 0, 1, 2
IMAGE_START, IMAGE_END, AUDIO_START, AUDIO_END, GEN_START, GEN_END = 3, 4, 5, 6, 7, 8
FIRST_TEXT_ID = 16
DELIMITERS = {"image": (IMAGE_START, IMAGE_END), "audio": (AUDIO_START, AUDIO_END),
              "image_out": (GEN_START, GEN_END)}
AUDIO_STRIDE = 2  # Whisper's second conv


@dataclass(frozen=True)
class SpecialTokens:
    """The ids assembly writes around documents and modality blocks. The defaults are the
    reserved ids above (synthetic and byte-level data); a real tokenizer supplies its own
    (`mmjax.data.tokenizer.Tokenizer.special_tokens`), its modality markers being added
    special tokens. Text ids must lie in [first_text, vocab_size)."""

    bos: int = BOS
    eos: int = EOS
    image_start: int = IMAGE_START
    image_end: int = IMAGE_END
    audio_start: int = AUDIO_START
    audio_end: int = AUDIO_END
    gen_start: int = GEN_START
    gen_end: int = GEN_END
    first_text: int = FIRST_TEXT_ID

    def delimiters(self, modality: str) -> tuple[int, int]:
        prefix = {"image": "image", "audio": "audio", "image_out": "gen"}[modality]
        return getattr(self, prefix + "_start"), getattr(self, prefix + "_end")


@dataclass(frozen=True)
class Segment:
    """One modality subsequence.

    text: int32 [L] token ids; image: float32 [H, W, 3] pixels; audio: float32 [T, n_mels]
    log-mel frames; image_out: float32 [C, h, w] latent to generate, read by `num_queries`
    LLM query tokens.
    """

    modality: str
    data: np.ndarray
    num_queries: int = 0  # image_out only
    # text only: bool [L], True where the token is trained (a chat's assistant turns);
    # None trains every token. A sample with masked text trains none of its wrapper tokens
    # (bos/eos, modality delimiters): those belong to no assistant turn.
    loss_mask: np.ndarray | None = None

    def __post_init__(self):
        if self.modality not in MODALITIES:
            raise ValueError(f"Segment.modality={self.modality!r}: use one of {MODALITIES}")
        if self.loss_mask is not None and (self.modality != "text"
                                           or np.shape(self.loss_mask) != np.shape(self.data)):
            raise ValueError("Segment.loss_mask: only for text, with the text's shape")

    @property
    def num_masked(self) -> int:
        """Text tokens left out of the loss."""
        if self.loss_mask is None:
            return 0
        return int(np.size(self.loss_mask) - np.count_nonzero(self.loss_mask))


@dataclass(frozen=True)
class Sample:
    id: int
    segments: tuple[Segment, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class SegmentMeta:
    modality: str
    num_llm_tokens: int  # placeholder/text tokens it occupies, without its delimiters
    num_encoder_tokens: int  # tokens in the encoder (generator for image_out); 0 for text
    input_size: int = 0  # image: patches; audio: frames; image_out: latent patches; text: L
    num_masked: int = 0  # text: tokens left out of the loss (chat prompts)
    delimiters: int = 0  # begin / end marker tokens around it (2 for a modality block, or 0)


@dataclass(frozen=True)
class SampleMeta:
    id: int
    segments: tuple[SegmentMeta, ...]

    @property
    def llm_length(self) -> int:
        """Tokens of this document in the LLM sequence: bos + eos + its blocks' markers."""
        return 2 + sum(s.num_llm_tokens + s.delimiters for s in self.segments)

    @property
    def num_placeholders(self) -> int:
        return sum(s.num_llm_tokens for s in self.segments if s.modality != "text")

    @property
    def num_masked(self) -> int:
        return sum(s.num_masked for s in self.segments)

    @property
    def num_targets(self) -> int:
        """Scored positions: every text/special token but bos is predicted exactly once;
        with masked text (loss on assistant turns only) just the unmasked text tokens."""
        if self.num_masked:
            return sum(s.num_llm_tokens - s.num_masked for s in self.segments
                       if s.modality == "text")
        return self.llm_length - self.num_placeholders - 1

    def encoder_tokens(self, modality: str) -> int:
        return sum(s.num_encoder_tokens for s in self.segments if s.modality == modality)

    def count(self, modality: str) -> int:
        return sum(1 for s in self.segments if s.modality == modality)


@dataclass(frozen=True)
class TokenRules:
    """The per-modality token-count rules of one model (see module docstring)."""

    patch_size: int = 14
    image_downsample: int = 1
    image_queries: int = 0  # > 0: cross-attention projector with this many queries per image
    audio_downsample: int = 1
    audio_queries: int = 0
    gen_patch_size: int = 2
    gen_downsample: int = 1  # image_out holds pixels (the VAE is a unit): its downsample
    markers: bool = True  # modality blocks wrapped in begin / end tokens (LLaVA: none)

    @classmethod
    def from_config(cls, cfg: MLLMConfig) -> "TokenRules":
        kw: dict[str, Any] = {}
        for spec in cfg.encoders:
            ca = spec.projector.kind == "cross_attention"
            if isinstance(spec.encoder, VisionConfig):
                kw.update(patch_size=spec.encoder.patch_size,
                          image_downsample=1 if ca else spec.projector.downsample,
                          image_queries=spec.projector.num_queries if ca else 0)
            else:
                kw.update(audio_downsample=1 if ca else spec.projector.downsample,
                          audio_queries=spec.projector.num_queries if ca else 0)
        if cfg.generator is not None:
            kw["gen_patch_size"] = cfg.generator.patch_size
            if cfg.vae is not None:
                kw["gen_downsample"] = cfg.vae.downsample
        return cls(markers=cfg.modality_markers, **kw)

    def segment_meta(self, modality: str, shape: tuple[int, ...], num_queries: int = 0,
                     num_masked: int = 0) -> SegmentMeta:
        """Metadata of a segment from its array shape alone (text: and its masked count)."""
        delimiters = 0 if modality == "text" or not self.markers else 2
        if modality == "text":
            return SegmentMeta("text", int(shape[0]), 0, int(shape[0]), int(num_masked))
        if modality == "image":
            n = (shape[0] // self.patch_size) * (shape[1] // self.patch_size)
            llm = self.image_queries or math.ceil(n / self.image_downsample)
            return SegmentMeta("image", llm, n, n, 0, delimiters)
        if modality == "audio":
            t = int(shape[0])
            enc = math.ceil(t / AUDIO_STRIDE)
            llm = self.audio_queries or math.ceil(enc / self.audio_downsample)
            return SegmentMeta("audio", llm, enc, t, 0, delimiters)
        if modality == "image_out":
            p = self.gen_patch_size * self.gen_downsample
            n = (shape[1] // p) * (shape[2] // p)
            return SegmentMeta("image_out", int(num_queries), n, n, 0, delimiters)
        raise ValueError(f"unknown modality {modality!r}; use one of {MODALITIES}")

    def llm_length(self, shapes) -> int:
        """`meta_from_shapes(i, shapes).llm_length` without building the metadata (a
        per-candidate check: `layout.check_shapes`)."""
        n = 2
        for e in shapes:
            mod, shape = e[0], e[1]
            if mod == "text":
                n += int(shape[0])
                continue
            n += 2 if self.markers else 0
            if mod == "image":
                p = self.patch_size
                n += self.image_queries or -(-(shape[0] // p) * (shape[1] // p)
                                             // self.image_downsample)
            elif mod == "audio":
                n += self.audio_queries or -(-(-(-shape[0] // AUDIO_STRIDE))
                                             // self.audio_downsample)
            elif mod == "image_out":
                n += int(e[2])
            else:
                raise ValueError(f"unknown modality {mod!r}; use one of {MODALITIES}")
        return int(n)

    def meta(self, sample: Sample) -> SampleMeta:
        return SampleMeta(sample.id, tuple(
            self.segment_meta(s.modality, s.data.shape, s.num_queries, s.num_masked)
            for s in sample.segments))

    def meta_from_shapes(self, sample_id: int, shapes) -> SampleMeta:
        """Metadata from (modality, shape, num_queries[, num_masked]) entries (a source's
        spec; the 4th field only for masked text), without any pixels."""
        return SampleMeta(sample_id, tuple(self.segment_meta(e[0], tuple(e[1]), *e[2:])
                                           for e in shapes))
