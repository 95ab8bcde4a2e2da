"""Batch assembly: interleave modality subsequences into fixed-shape LLM rows (no JAX).

DistTrain §2.3 (interleaved subsequences in a fixed-length sequence, DistTrain: one sample
per row, padded -> packing="pad") and OrchMLLM §2.2/§6 (OrchMLLM: sequences packed without
padding, subsequences assembled in the example's order -> packing="pack"). Placeholders are
scattered from the projected encoder outputs by `gather_<encoder>` (placement "embed") or
put before the text (placement "prepend", Cornstarch Fig. 11). Masks use Cornstarch's
bitfield attention mask (Cornstarch §4.3.1).

Document layout in a row (embed): bos, then per segment in order: text ids |
image_start <image tokens> image_end | audio_start <audio tokens> audio_end |
gen_start <K query tokens> gen_end, then eos. With "prepend", every image/audio block of
the sample comes right after bos, then text and image_out segments in order (image_out
stays after its prompt: it is an output).

Encoder buffers: images are packed first-fit-decreasing into `Nb` buffers of `cap` patches,
each image's run padded (patch_seg 0) to a multiple of the projector downsample r. Audio
clips take one row each of `frames_cap` frames. Capacities come from the layout's bucket
sets and counts are rounded up to powers of two, so jit sees few shapes. Token-count rules:
`mmjax.data.sample.TokenRules`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from mmjax.data.sample import (AUDIO_STRIDE, Sample, SampleMeta, SpecialTokens, TokenRules)
from mmjax.models.config import MLLMConfig, VisionConfig


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


@dataclass(frozen=True)
class GenSlot:
    latent_shape: tuple[int, int, int]  # (C, h, w)
    patch_size: int
    num_queries: int  # K query tokens per image_out
    num_train_timesteps: int

    @property
    def num_patches(self) -> int:
        return (self.latent_shape[1] // self.patch_size) * (self.latent_shape[2] // self.patch_size)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.latent_shape[0]


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


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

    @classmethod
    def from_config(cls, cfg: MLLMConfig, seq_len: int, packing: str = "pad",
                    vision_caps: tuple[int, ...] = (256, 1024, 4096),
                    audio_frame_caps: tuple[int, ...] = (256, 1024, 3072),
                    gen_num_queries: int = 16,
                    special: SpecialTokens | None = None) -> "AssemblyLayout":
        if packing not in ("pad", "pack"):
            raise ValueError(f"packing={packing!r}: use 'pad' (DistTrain) or 'pack' (OrchMLLM)")
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
                                         enc.patch_size, enc.max_grid))
                bad = [c for c in vision_caps if c % r]
                if bad:
                    raise ValueError(f"vision_caps {bad} not multiples of downsample {r}")
            else:
                slots.append(EncoderSlot(spec.name, "audio", i + 1, r,
                                         spec.projector.num_queries if ca else 0,
                                         spec.projector.max_items, enc.num_mel_bins))
                bad = [c for c in audio_frame_caps if c % (AUDIO_STRIDE * r)]
                if bad:
                    raise ValueError(f"audio_frame_caps {bad} not multiples of "
                                     f"{AUDIO_STRIDE}*downsample={AUDIO_STRIDE * r}")
        gen = None
        if cfg.generator is not None:
            g = cfg.generator
            gen = GenSlot((g.latent_channels, g.latent_size, g.latent_size), g.patch_size,
                          gen_num_queries, g.num_train_timesteps)
        return cls(seq_len, cfg.llm.vocab_size, TokenRules.from_config(cfg), tuple(slots), gen,
                   packing, cfg.placement, tuple(sorted(vision_caps)),
                   tuple(sorted(audio_frame_caps)), special or SpecialTokens())

    def slot(self, modality: str) -> EncoderSlot | None:
        for s in self.encoders:
            if s.modality == modality:
                return s
        return None

    @property
    def text_bits(self) -> int:
        return 1 | sum(1 << s.bit for s in self.encoders)


# ---------------------------------------------------------------------------------------
# Rejection of bad samples
# ---------------------------------------------------------------------------------------

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
            if tuple(shape) != layout.gen.latent_shape:
                return f"decode: {where} latent shape {shape} != {layout.gen.latent_shape}"
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
    meta = layout.rules.meta_from_shapes(-1, shapes)
    if meta.llm_length > layout.seq_len:
        return f"too_long: {meta.llm_length} LLM tokens > seq_len {layout.seq_len}"
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


# ---------------------------------------------------------------------------------------
# Shapes (bucket capacities) from metadata only
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BatchShapes:
    """Static shapes of one assembled batch: LLM rows, and per encoder (count, capacity)
    = (Nb, cap patches) for vision or (Nc, frames_cap) for audio; G image_out slots."""

    rows: int
    encoders: tuple[tuple[str, int, int], ...] = ()
    gen: int = 0

    def encoder(self, name: str) -> tuple[int, int]:
        for n, count, cap in self.encoders:
            if n == name:
                return count, cap
        raise KeyError(name)


def _bucket(need: int, caps: tuple[int, ...]) -> int:
    for c in caps:
        if c >= need:
            return c
    raise ValueError(f"need capacity {need} > largest bucket {caps[-1]}")


def pack_rows(lengths: list[int], seq_len: int, packing: str) -> list[int]:
    """Row of each document: one per row ("pad"), or first fit in order ("pack")."""
    if packing == "pad":
        return list(range(len(lengths)))
    free: list[int] = []
    rows = []
    for n in lengths:
        for r, f in enumerate(free):
            if f >= n:
                free[r] -= n
                rows.append(r)
                break
        else:
            free.append(seq_len - n)
            rows.append(len(free) - 1)
    return rows


def pack_images(runs: list[int], cap: int, max_items: int | None) -> list[tuple[int, int, int]]:
    """(buffer, patch offset, 1-based seg id) per image: first fit decreasing by run length
    (ties by order), at most `max_items` images per buffer when given."""
    order = sorted(range(len(runs)), key=lambda i: (-runs[i], i))
    free, items = [], []
    out: list[tuple[int, int, int]] = [(0, 0, 0)] * len(runs)
    for i in order:
        for b in range(len(free)):
            if free[b] >= runs[i] and (max_items is None or items[b] < max_items):
                break
        else:
            free.append(cap)
            items.append(0)
            b = len(free) - 1
        out[i] = (b, cap - free[b], items[b] + 1)
        free[b] -= runs[i]
        items[b] += 1
    return out


def _image_runs(metas: list[SampleMeta], slot: EncoderSlot) -> list[int]:
    r = slot.downsample
    return [math.ceil(s.input_size / r) * r for m in metas for s in m.segments
            if s.modality == "image"]


def _audio_frames(metas: list[SampleMeta]) -> list[int]:
    return [s.input_size for m in metas for s in m.segments if s.modality == "audio"]


def batch_shapes(groups: list[list[SampleMeta]], layout: AssemblyLayout) -> BatchShapes:
    """Common static shapes for several batches (e.g. all DP ranks of one microbatch, which
    must share shapes inside one SPMD program): per field the max over `groups`."""
    rows = 1
    for metas in groups:
        lens = [m.llm_length for m in metas]
        rows = max(rows, (max(pack_rows(lens, layout.seq_len, layout.packing)) + 1) if lens else 1)
    if layout.packing == "pack":
        rows = _pow2(rows)
    encs = []
    for slot in layout.encoders:
        if slot.modality == "image":
            runs = [_image_runs(m, slot) for m in groups]
            cap = _bucket(max([max(r) for r in runs if r] or [0]), layout.vision_caps)
            mi = slot.max_items if slot.queries else None
            nb = max([max(b for b, _, _ in pack_images(r, cap, mi)) + 1 for r in runs if r] or [1])
            encs.append((slot.name, _pow2(nb), cap))
        else:
            frames = [_audio_frames(m) for m in groups]
            cap = _bucket(max([max(f) for f in frames if f] or [0]), layout.audio_frame_caps)
            encs.append((slot.name, _pow2(max([len(f) for f in frames] + [1])), cap))
    gen = 0
    if layout.gen is not None:
        gen = _pow2(max([sum(m.count("image_out") for m in metas) for metas in groups] + [1]))
    return BatchShapes(rows, tuple(encs), gen)


# ---------------------------------------------------------------------------------------
# Assembly
# ---------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One assembled batch (numpy). LLM side [B, S]; `gather[e]` indexes encoder e's
    flattened projected output; `encoders[e]` holds its inputs; `gen` the generator's."""

    tokens: np.ndarray
    targets: np.ndarray
    loss_mask: np.ndarray
    positions: np.ndarray
    doc: np.ndarray
    sub: np.ndarray
    bam: np.ndarray
    gather: dict[str, np.ndarray]
    encoders: dict[str, dict[str, np.ndarray]]
    gen: dict[str, np.ndarray] | None
    num_target_tokens: int
    num_gen_elements: int
    shapes: BatchShapes
    sample_ids: list[int] = field(default_factory=list)  # kept samples, in input order
    doc_index: list[tuple[int, int]] = field(default_factory=list)  # (row, doc id) of each
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        """Flat dict: LLM fields, gather_<e>, <e>/<field> encoder inputs, gen_* fields."""
        out = {k: getattr(self, k) for k in
               ("tokens", "targets", "loss_mask", "positions", "doc", "sub", "bam")}
        out.update({f"gather_{e}": g for e, g in self.gather.items()})
        for e, d in self.encoders.items():
            out.update({f"{e}/{k}": v for k, v in d.items()})
        out.update(self.gen or {})
        return out


def patchify(image: np.ndarray, p: int) -> np.ndarray:
    """[H, W, C] -> [(H/p)(W/p), p*p*C], patches row-major, each flattened (py, px, c)."""
    h, w, c = image.shape
    x = image.reshape(h // p, p, w // p, p, c).transpose(0, 2, 1, 3, 4)
    return x.reshape((h // p) * (w // p), p * p * c)


def gen_noise_and_t(sample_id: int, segment_index: int, shape, num_timesteps: int):
    """Diffusion noise and timestep fixed by (sample id, segment), so every plan and
    every reordering sees the same noise (loss invariance under permutation)."""
    rng = np.random.default_rng([int(sample_id) & 0xFFFFFFFF, segment_index, 0x5EED])
    t = int(rng.integers(0, num_timesteps))
    return rng.standard_normal(shape, dtype=np.float32), t


def _doc_blocks(sample: Sample, placement: str):
    """Segments (with their index) in LLM order for this placement."""
    idx = list(enumerate(sample.segments))
    if placement == "prepend":
        mods = [(i, s) for i, s in idx if s.modality in ("image", "audio")]
        rest = [(i, s) for i, s in idx if s.modality not in ("image", "audio")]
        return mods + rest
    return idx


def assemble(samples: list[Sample], layout: AssemblyLayout, shapes: BatchShapes | None = None,
             encoder_inputs: bool = True) -> Batch:
    """Assemble `samples` (in order) into one Batch. Bad samples (see `check_sample`) are
    left out and listed in `Batch.skipped`. `shapes` forces common static shapes (from
    `batch_shapes` over several groups); it must be large enough. `encoder_inputs=False`
    leaves out encoder pixels/frames (gather indices are still filled), for an LLM rank whose
    encoders run elsewhere."""
    good, skipped = [], []
    for s in samples:
        reason = check_sample(s, layout)
        (skipped.append((s.id, reason)) if reason else good.append(s))
    metas = [layout.rules.meta(s) for s in good]
    need = batch_shapes([metas], layout)
    shapes = shapes or need
    _check_fits(need, shapes)
    S, B = layout.seq_len, shapes.rows

    tokens = np.zeros((B, S), np.int32)
    positions = np.zeros((B, S), np.int32)
    doc = np.zeros((B, S), np.int32)
    sub = np.zeros((B, S), np.int32)
    bam = np.zeros((B, S), np.int64)
    is_text = np.zeros((B, S), bool)
    trained = np.zeros((B, S), bool)  # the token at this position is a loss target
    gather = {e.name: np.full((B, S), -1, np.int32) for e in layout.encoders}

    # Encoder-side placement of every image / audio clip, in batch order.
    enc_out, place = {}, {}
    for slot in layout.encoders:
        count, cap = shapes.encoder(slot.name)
        if slot.modality == "image":
            runs = _image_runs(metas, slot)
            place[slot.name] = pack_images(runs, cap, slot.max_items if slot.queries else None)
            used = max([b for b, _, _ in place[slot.name]] or [-1]) + 1
            _check_count(slot.name, used, count)
            if encoder_inputs:
                enc_out[slot.name] = {
                    "patches": np.zeros((count, cap, slot.feature_dim), np.float32),
                    "patch_seg": np.zeros((count, cap), np.int32),
                    "patch_pos": np.zeros((count, cap, 2), np.int32)}
        else:
            place[slot.name] = list(range(len(_audio_frames(metas))))
            _check_count(slot.name, len(place[slot.name]), count)
            if encoder_inputs:
                enc_out[slot.name] = {
                    "mels": np.zeros((count, cap, slot.feature_dim), np.float32),
                    "frame_len": np.zeros((count,), np.int32)}
    gen = None
    if layout.gen is not None:
        g, K = shapes.gen, layout.gen.num_queries
        npch, pdim = layout.gen.num_patches, layout.gen.patch_dim
        gen = {"gen_query": np.zeros((g, K), np.int32),
               "gen_latents": np.zeros((g, npch, pdim), np.float32),
               "gen_noise": np.zeros((g, npch, pdim), np.float32),
               "gen_t": np.zeros((g,), np.int32), "gen_valid": np.zeros((g,), np.float32)}

    rows = pack_rows([m.llm_length for m in metas], S, layout.packing)
    fill = [0] * B
    docs_in_row = [0] * B
    sub_next = [1] * B
    counters = {"image": 0, "audio": 0, "image_out": 0}
    row_ids: list[int] = []
    where: list[tuple[int, int]] = []
    for sample, row in zip(good, rows):
        col0 = fill[row]
        docs_in_row[row] += 1
        doc_id = docs_in_row[row]
        col = col0
        wrappers_trained = all(s.num_masked == 0 for s in sample.segments)

        def put_text(ids, mask=None):
            nonlocal col
            n = len(ids)
            tokens[row, col:col + n] = ids
            bam[row, col:col + n] = layout.text_bits
            is_text[row, col:col + n] = True
            trained[row, col:col + n] = wrappers_trained if mask is None else mask
            col += n

        sp = layout.special
        put_text([sp.bos])
        for seg_index, seg in _doc_blocks(sample, layout.placement):
            if seg.modality == "text":
                put_text(np.asarray(seg.data, np.int32),
                         True if seg.loss_mask is None else np.asarray(seg.loss_mask, bool))
                continue
            start, end = sp.delimiters(seg.modality)
            put_text([start])
            k = counters[seg.modality]
            counters[seg.modality] += 1
            n = layout.rules.segment_meta(seg.modality, seg.data.shape, seg.num_queries).num_llm_tokens
            span = slice(col, col + n)
            sub[row, span] = sub_next[row]
            sub_next[row] += 1
            if seg.modality == "image_out":
                bam[row, span] = layout.text_bits
                gen["gen_query"][k] = row * S + np.arange(col, col + n)
                lat = np.ascontiguousarray(seg.data.transpose(1, 2, 0), np.float32)
                gen["gen_latents"][k] = patchify(lat, layout.gen.patch_size)
                noise, t = gen_noise_and_t(sample.id, seg_index, (npch, pdim),
                                           layout.gen.num_train_timesteps)
                gen["gen_noise"][k], gen["gen_t"][k], gen["gen_valid"][k] = noise, t, 1.0
            else:
                slot = layout.slot(seg.modality)
                bam[row, span] = 1 << slot.bit
                gather[slot.name][row, span] = _gather_rows(slot, shapes, place[slot.name][k], n)
                if encoder_inputs:
                    _put_encoder_input(slot, enc_out[slot.name], place[slot.name][k], seg.data)
            col += n
            put_text([end])
        put_text([sp.eos])
        doc[row, col0:col] = doc_id
        positions[row, col0:col] = np.arange(col - col0)
        fill[row] = col
        row_ids.append(sample.id)
        where.append((row, doc_id))

    nxt_ok = np.zeros((B, S), bool)
    nxt_ok[:, :-1] = ((doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] != 0) & is_text[:, 1:]
                      & trained[:, 1:])
    targets = np.where(nxt_ok, np.roll(tokens, -1, axis=1), 0).astype(np.int32)
    loss_mask = nxt_ok.astype(np.float32)
    n_gen = int(gen["gen_valid"].sum()) * layout.gen.num_patches * layout.gen.patch_dim if gen else 0
    return Batch(tokens, targets, loss_mask, positions, doc, sub, bam, gather, enc_out, gen,
                 int(loss_mask.sum()), n_gen, shapes, row_ids, where, skipped)


def _check_fits(need: BatchShapes, have: BatchShapes) -> None:
    if need.rows > have.rows:
        raise ValueError(f"BatchShapes.rows={have.rows} < {need.rows} rows needed")
    for (name, _, c_need), (_, _, c_have) in zip(need.encoders, have.encoders):
        if c_need > c_have:
            raise ValueError(f"BatchShapes[{name}] capacity {c_have} < {c_need} needed")
    if need.gen > have.gen:
        raise ValueError(f"BatchShapes.gen={have.gen} < {need.gen} image_out slots needed")


def projected_size(slot: EncoderSlot, shapes: BatchShapes) -> int:
    """Rows of encoder `slot`'s flattened projected output for these shapes."""
    count, cap = shapes.encoder(slot.name)
    if slot.queries:
        return count * slot.max_items * slot.queries
    per = cap // slot.downsample if slot.modality == "image" else cap // AUDIO_STRIDE // slot.downsample
    return count * per


def item_rows(metas: list[SampleMeta], layout: AssemblyLayout, shapes: BatchShapes
              ) -> dict[str, list[np.ndarray]]:
    """Per encoder, per item (image / clip, in batch order) the rows of its projected tokens
    in the flattened encoder output: what `gather_<e>` points at, from metadata only (the
    loader maps these rows between encoder and LLM ranks)."""
    out = {}
    for slot in layout.encoders:
        count, cap = shapes.encoder(slot.name)
        if slot.modality == "image":
            place = pack_images(_image_runs(metas, slot), cap,
                                slot.max_items if slot.queries else None)
        else:
            place = list(range(len(_audio_frames(metas))))
        ns = [s.num_llm_tokens for m in metas for s in m.segments if s.modality == slot.modality]
        out[slot.name] = [_gather_rows(slot, shapes, w, n) for w, n in zip(place, ns)]
    return out


def _check_count(name: str, used: int, count: int) -> None:
    if used > count:
        raise ValueError(f"BatchShapes[{name}] has {count} buffers but {used} are needed; "
                         f"compute shapes with batch_shapes over these samples")


def _gather_rows(slot: EncoderSlot, shapes: BatchShapes, where, n: int) -> np.ndarray:
    """Indices of an item's n projected tokens in the flattened encoder output."""
    count, cap = shapes.encoder(slot.name)
    if slot.modality == "image":
        b, offset, seg = where
        if slot.queries:
            return (b * slot.max_items + seg - 1) * slot.queries + np.arange(n)
        return b * (cap // slot.downsample) + offset // slot.downsample + np.arange(n)
    c = where
    if slot.queries:
        return c * slot.max_items * slot.queries + np.arange(n)
    return c * (cap // AUDIO_STRIDE // slot.downsample) + np.arange(n)


def _put_encoder_input(slot: EncoderSlot, buf: dict, where, data: np.ndarray) -> None:
    if slot.modality == "image":
        b, offset, seg = where
        p = slot.patch_size
        gh, gw = data.shape[0] // p, data.shape[1] // p
        n = gh * gw
        if b >= buf["patches"].shape[0]:
            raise ValueError(f"vision buffers: image needs buffer {b} but BatchShapes gives "
                             f"{buf['patches'].shape[0]}; compute shapes with batch_shapes")
        buf["patches"][b, offset:offset + n] = patchify(data.astype(np.float32), p)
        buf["patch_seg"][b, offset:offset + n] = seg
        rr, cc = np.divmod(np.arange(n), gw)
        buf["patch_pos"][b, offset:offset + n, 0] = rr
        buf["patch_pos"][b, offset:offset + n, 1] = cc
    else:
        c = where
        t = data.shape[0]
        if c >= buf["mels"].shape[0]:
            raise ValueError(f"audio buffers: clip {c} but BatchShapes gives {buf['mels'].shape[0]}")
        buf["mels"][c, :t] = data
        buf["frame_len"][c] = t
