"""The assembly layout (no JAX): LLM row length, packing ("pad": one sample per row,
DistTrain §2.3; "pack": first fit decreasing, OrchMLLM §2.2), placement of encoder tokens
("embed" in place or "prepend", Cornstarch Fig. 11), encoder slots with their bucket
capacities and bitfield bits (Cornstarch §4.3.1), the generator slot; and the rejection of
samples that cannot be assembled (from shapes alone, so planning can skip them before decoding).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

from mmjax.errors import UserError
from mmjax.data.sample import AUDIO_STRIDE, Sample, SpecialTokens, TokenRules
from mmjax.models.config import MLLMConfig, VisionConfig

PACKINGS = ("pad", "pack")  # DistTrain's padded rows, OrchMLLM's packed rows


@dataclass(frozen=True)
class EncoderSlot:
    """How one encoder branch reads its inputs and lays out its projected outputs."""

    name: str
    modality: str  # "image" or "audio"
    bit: int  # BAM bit = encoder index + 1
    downsample: int  # r (1 for cross-attention)
    queries: int  # > 0: cross-attention projector, tokens per item
    max_items: int  # cross-attention: item slots per buffer row
    feature_dim: int  # patch_dim (vision) or n_mels (audio)
    patch_size: int = 0  # vision
    max_grid: int = 0  # vision: max patches per side
    class_slots: int = 0  # vision with a class token: images per buffer row at most
    # vision kind="qwen2_vl": its spatial merge size (sides are multiples of patch_size *
    # merge; patches in HF's merge-block order, data/qwen2_vl_processor.py); 0 otherwise
    merge: int = 0

    @property
    def items_per_buffer(self) -> int | None:
        """Images per buffer row at most (cross-attention item slots, class-token slots)."""
        if self.queries:
            return self.max_items
        return self.class_slots or None


@dataclass(frozen=True)
class GenSlot:
    latent_shape: tuple[int, int, int]  # (C, h, w)
    patch_size: int
    num_queries: int  # K query tokens per image_out
    num_train_timesteps: int
    # > 0: the VAE is a unit of the model (device placement): image_out segments carry the
    # target's pixels [3, side, side] in [-1, 1] and the batch `gen_pixels`, not latents
    pixel_side: int = 0

    @property
    def data_shape(self) -> tuple[int, int, int]:
        """What an image_out segment holds: latents (C, h, w), or pixels (3, side, side)."""
        return (3, self.pixel_side, self.pixel_side) if self.pixel_side else self.latent_shape

    @property
    def num_patches(self) -> int:
        return (self.latent_shape[1] // self.patch_size) * (self.latent_shape[2] // self.patch_size)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.latent_shape[0]


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def shape_bucket(n: int) -> int:
    """Static batch dimension for `n` rows / buffers: 1, 2, 4, then the smallest m * 2^k >= n
    with m in 4..7 (5, 6, 7, 8, 10, 12, 14, 16, 20, ...). At most 4 shapes per octave (few
    compiles, as shapes only grow) and under 25% padding, where a power of two wastes up to
    half the step (9 packed rows padded to 16)."""
    if n <= 4:
        return next_pow2(n)
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


@dataclass(frozen=True)
class AssemblyLayout:
    seq_len: int
    vocab_size: int
    rules: TokenRules
    encoders: tuple[EncoderSlot, ...] = ()
    gen: GenSlot | None = None
    packing: Literal["pad", "pack"] = "pad"
    placement: Literal["embed", "prepend"] = "embed"
    vision_caps: tuple[int, ...] = (256, 1024, 4096)
    audio_frame_caps: tuple[int, ...] = (256, 1024, 3072)
    special: SpecialTokens = SpecialTokens()  # a tokenizer's ids, or the reserved ones
    # Qwen2-VL M-RoPE (LLMConfig.mrope_section set): positions [B, S, 3] (t, h, w), an
    # image's tokens on its merged grid (HF get_rope_index, `assemble._mrope_positions`)
    mrope: bool = False
    image_attention: Literal["bidirectional", "causal"] = "bidirectional"  # MLLMConfig's

    @classmethod
    def from_config(cls, cfg: MLLMConfig, seq_len: int, packing: str = "pad",
                    vision_caps: tuple[int, ...] = (256, 1024, 4096),
                    audio_frame_caps: tuple[int, ...] = (256, 1024, 3072),
                    gen_num_queries: int = 16,
                    special: SpecialTokens | None = None) -> "AssemblyLayout":
        if packing not in PACKINGS:
            raise UserError(f"packing={packing!r}: use 'pad' (DistTrain) or 'pack' (OrchMLLM)")
        slots, seen = [], set()
        for i, spec in enumerate(cfg.encoders):
            if spec.modality in seen:
                raise ValueError(f"MLLMConfig.encoders: two encoders for modality "
                                 f"{spec.modality!r}; assembly maps each modality to one encoder")
            seen.add(spec.modality)
            ca = spec.projector.kind == "cross_attention"
            r = 1 if ca else spec.projector.downsample
            enc = spec.encoder
            if isinstance(enc, VisionConfig):
                slots.append(EncoderSlot(spec.name, "image", i + 1, r,
                                         spec.projector.num_queries if ca else 0,
                                         spec.projector.max_items, enc.patch_dim,
                                         enc.patch_size, enc.max_grid,
                                         enc.max_images if enc.class_token else 0,
                                         enc.spatial_merge_size if enc.kind == "qwen2_vl" else 0))
                bad = [c for c in vision_caps if c % r]
                if bad:
                    raise UserError(f"vision_caps {bad} not multiples of downsample {r}")
            else:
                slots.append(EncoderSlot(spec.name, "audio", i + 1, r,
                                         spec.projector.num_queries if ca else 0,
                                         spec.projector.max_items, enc.num_mel_bins))
                bad = [c for c in audio_frame_caps if c % (AUDIO_STRIDE * r)]
                if bad:
                    raise UserError(f"audio_frame_caps {bad} not multiples of "
                                     f"{AUDIO_STRIDE}*downsample={AUDIO_STRIDE * r}")
        gen = None
        if cfg.generator is not None:
            g = cfg.generator
            gen = GenSlot((g.latent_channels, g.latent_size, g.latent_size), g.patch_size,
                          gen_num_queries, g.num_train_timesteps,
                          g.latent_size * cfg.vae.downsample if cfg.vae is not None else 0)
        special = special or SpecialTokens()
        if cfg.image_markers is not None:  # the checkpoint's own (Qwen2-VL's vision_start/end)
            special = dataclasses.replace(special, image_start=int(cfg.image_markers[0]),
                                          image_end=int(cfg.image_markers[1]))
        return cls(seq_len, cfg.llm.vocab_size, TokenRules.from_config(cfg), tuple(slots), gen,
                   cast(Literal["pad", "pack"], packing),  # checked against PACKINGS above
                   cfg.placement, tuple(sorted(vision_caps)),
                   tuple(sorted(audio_frame_caps)), special,
                   cfg.llm.mrope_section is not None, cfg.image_attention)

    def slot(self, modality: str) -> EncoderSlot | None:
        for s in self.encoders:
            if s.modality == modality:
                return s
        return None

    @property
    def text_bits(self) -> int:
        return 1 | sum(1 << s.bit for s in self.encoders)

    @property
    def llm_mask_family(self) -> str:
        """"causal" when every LLM row is one causal text document with its real tokens
        first (no encoders, packing "pad"): cuDNN can run it (models/attention.py); else
        "bam", the general bitfield mask."""
        return "causal" if not self.encoders and self.packing == "pad" else "bam"


def check_shapes(shapes, layout: AssemblyLayout) -> str | None:
    """Reason a sample cannot be assembled, from (modality, shape, num_queries) triples
    alone (what planning sees), or None. Reasons start with empty/decode/too_long/unsupported."""
    if not shapes:
        return "empty: sample has no segments"
    for i, (mod, shape, k, *_) in enumerate(shapes):
        where = f"segment {i} ({mod})"
        if mod == "text":
            if len(shape) != 1:
                return f"decode: {where} has shape {shape}, expected [L]"
            if shape[0] == 0:
                return f"empty: {where} has no tokens"
            continue
        if mod == "image_out":
            if layout.gen is None:
                return f"unsupported: {where} but the model has no generator"
            if tuple(shape) != layout.gen.data_shape:
                return f"decode: {where} shape {shape} != {layout.gen.data_shape}"
            if k != layout.gen.num_queries:
                return f"decode: {where} reads {k} query tokens, layout has {layout.gen.num_queries}"
            continue
        slot = layout.slot(mod)
        if slot is None:
            return f"unsupported: {where} but the model has no {mod} encoder"
        if mod == "image":
            p = slot.patch_size
            if len(shape) != 3 or shape[2] != 3:
                return f"decode: {where} has shape {shape}, expected [H, W, 3]"
            if shape[0] == 0 or shape[1] == 0:
                return f"empty: {where} has no pixels"
            if shape[0] % p or shape[1] % p:
                return f"decode: {where} side {shape[:2]} not a multiple of patch size {p}"
            unit = p * max(slot.merge, 1)
            if shape[0] % unit or shape[1] % unit:
                return (f"decode: {where} side {shape[:2]} not a multiple of patch size * "
                        f"merge size {unit} (Qwen2-VL)")
            if max(shape[0], shape[1]) // p > slot.max_grid:
                return f"too_long: {where} grid {shape[0] // p}x{shape[1] // p} > max_grid {slot.max_grid}"
            n = (shape[0] // p) * (shape[1] // p)
            if math.ceil(n / slot.downsample) * slot.downsample > layout.vision_caps[-1]:
                return f"too_long: {where} has {n} patches > largest vision cap {layout.vision_caps[-1]}"
        else:  # audio
            if len(shape) != 2 or shape[1] != slot.feature_dim:
                return f"decode: {where} has shape {shape}, expected [T, {slot.feature_dim}]"
            if shape[0] == 0:
                return f"empty: {where} has no frames"
            if shape[0] > layout.audio_frame_caps[-1]:
                return f"too_long: {where} has {shape[0]} frames > largest cap {layout.audio_frame_caps[-1]}"
    length = layout.rules.llm_length(shapes)
    if length > layout.seq_len:
        return f"too_long: {length} LLM tokens > seq_len {layout.seq_len}"
    return None


def sample_shapes(sample: Sample):
    """The sample's spec: (modality, shape, num_queries), plus num_masked for masked text."""
    return [(s.modality, tuple(np.shape(s.data)), s.num_queries)
            + ((s.num_masked,) if s.num_masked else ()) for s in sample.segments]


def check_sample(sample: Sample, layout: AssemblyLayout) -> str | None:
    """Why `sample` cannot be assembled (a reason string), or None if it can."""
    for i, s in enumerate(sample.segments):
        if not isinstance(s.data, np.ndarray):
            return f"decode: segment {i} ({s.modality}) data is {type(s.data).__name__}, not ndarray"
        if s.modality == "text":
            if not np.issubdtype(s.data.dtype, np.integer):
                return f"decode: segment {i} (text) dtype {s.data.dtype} is not integer"
        elif not np.issubdtype(s.data.dtype, np.floating):
            return f"decode: segment {i} ({s.modality}) dtype {s.data.dtype} is not floating"
    reason = check_shapes(sample_shapes(sample), layout)
    if reason is not None:
        return reason
    for i, s in enumerate(sample.segments):
        lo = layout.special.first_text
        if s.modality == "text" and (s.data.min() < lo or s.data.max() >= layout.vocab_size):
            return (f"decode: segment {i} (text) ids outside [{lo}, "
                    f"{layout.vocab_size})")
        if s.modality != "text" and not np.isfinite(s.data).all():
            return f"decode: segment {i} ({s.modality}) has non-finite values"
    return None
