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

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from mmjax.data.batch_shapes import (BatchShapes, audio_frames, image_runs, batch_shapes,
                                     pack_images, pack_rows)
from mmjax.data.layout import AssemblyLayout, EncoderSlot, GenSlot, check_sample
from mmjax.data.qwen2_vl_processor import patchify as qwen_patchify
from mmjax.data.sample import AUDIO_STRIDE, Sample, SampleMeta
from mmjax.models.qwen2_vl_config import merged_grid, patch_positions, vision_token_positions


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
    enc_out, place = _encoder_buffers(layout, metas, shapes, encoder_inputs)
    gen = _generator_buffers(layout, shapes)
    rows = _Rows(layout, shapes, gen, enc_out if encoder_inputs else None, place)
    row_ids, where = [], []
    for sample, row in zip(good, pack_rows([m.llm_length for m in metas], layout.seq_len,
                                           layout.packing)):
        where.append(rows.put_document(sample, row))
        row_ids.append(sample.id)
    targets, loss_mask = rows.targets()
    g = cast(GenSlot, layout.gen)  # set whenever there are generator buffers
    n_gen = int(gen["gen_valid"].sum()) * g.num_patches * g.patch_dim if gen else 0
    return Batch(rows.tokens, targets, loss_mask, rows.positions, rows.doc, rows.sub, rows.bam,
                 rows.gather, enc_out, gen, int(loss_mask.sum()), n_gen, shapes, row_ids, where,
                 skipped)


def _encoder_buffers(layout: AssemblyLayout, metas: list[SampleMeta], shapes: BatchShapes,
                     encoder_inputs: bool) -> tuple[dict, dict]:
    """Zeroed encoder input buffers (when `encoder_inputs`) and every item's place in them,
    in batch order: images packed first-fit-decreasing into buffers, audio one per row."""
    enc_out: dict[str, Any] = {}
    place: dict[str, list[Any]] = {}
    for slot in layout.encoders:
        count, cap = shapes.encoder(slot.name)
        if slot.modality == "image":
            place[slot.name] = pack_images(image_runs(metas, slot), cap, slot.items_per_buffer)
            used = max([b for b, _, _ in place[slot.name]] or [-1]) + 1
            _check_count(slot.name, used, count)
            if encoder_inputs:
                enc_out[slot.name] = {
                    "patches": np.zeros((count, cap, slot.feature_dim), np.float32),
                    "patch_seg": np.zeros((count, cap), np.int32),
                    "patch_pos": np.zeros((count, cap, 2), np.int32)}
        else:
            place[slot.name] = list(range(len(audio_frames(metas))))
            _check_count(slot.name, len(place[slot.name]), count)
            if encoder_inputs:
                enc_out[slot.name] = {
                    "mels": np.zeros((count, cap, slot.feature_dim), np.float32),
                    "frame_len": np.zeros((count,), np.int32)}
    return enc_out, place


def _generator_buffers(layout: AssemblyLayout, shapes: BatchShapes) -> dict | None:
    if layout.gen is None:
        return None
    g, k = shapes.gen, layout.gen.num_queries
    npch, pdim, side = layout.gen.num_patches, layout.gen.patch_dim, layout.gen.pixel_side
    target = ({"gen_pixels": np.zeros((g, side, side, 3), np.float32)} if side else
              {"gen_latents": np.zeros((g, npch, pdim), np.float32)})
    return {"gen_query": np.zeros((g, k), np.int32), **target,
            "gen_noise": np.zeros((g, npch, pdim), np.float32),
            "gen_t": np.zeros((g,), np.int32), "gen_valid": np.zeros((g,), np.float32)}


class _Rows:
    """The LLM side [B, S] being filled document by document (the layout in the module
    docstring), plus the generator's and encoders' buffers the documents point into."""

    def __init__(self, layout: AssemblyLayout, shapes: BatchShapes, gen, enc_out, place):
        b, s = shapes.rows, layout.seq_len
        self.layout, self.shapes, self.gen, self.enc_out, self.place = (
            layout, shapes, gen, enc_out, place)
        self.tokens = np.zeros((b, s), np.int32)
        self.positions = np.zeros((b, s, 3) if layout.mrope else (b, s), np.int32)
        self.images: list[tuple[int, int, int]] = []  # this document's (col, rows, cols)
        self.doc, self.sub = np.zeros((b, s), np.int32), np.zeros((b, s), np.int32)
        self.bam = np.zeros((b, s), np.int64)
        self.is_text = np.zeros((b, s), bool)
        self.trained = np.zeros((b, s), bool)  # the token at this position is a loss target
        self.gather = {e.name: np.full((b, s), -1, np.int32) for e in layout.encoders}
        self.fill, self.docs, self.sub_next = [0] * b, [0] * b, [1] * b
        self.counters = {"image": 0, "audio": 0, "image_out": 0}

    def _text(self, row: int, col: int, ids, trained) -> int:
        n = len(ids)
        self.tokens[row, col:col + n] = ids
        self.bam[row, col:col + n] = self.layout.text_bits
        self.is_text[row, col:col + n] = True
        self.trained[row, col:col + n] = trained
        return col + n

    def put_document(self, sample: Sample, row: int) -> tuple[int, int]:
        """Write `sample` after the row's last document; -> (row, document id)."""
        col0 = col = self.fill[row]
        self.images = []
        self.docs[row] += 1
        doc_id, sp = self.docs[row], self.layout.special
        wrappers = all(s.num_masked == 0 for s in sample.segments)
        col = self._text(row, col, [sp.bos], wrappers)
        for seg_index, seg in _doc_blocks(sample, self.layout.placement):
            if seg.modality == "text":
                col = self._text(row, col, np.asarray(seg.data, np.int32),
                                 True if seg.loss_mask is None else np.asarray(seg.loss_mask, bool))
                continue
            if not self.layout.rules.markers:  # LLaVA: the block alone
                col = self._modality(sample, seg_index, seg, row, col)
                continue
            start, end = sp.delimiters(seg.modality)
            col = self._text(row, col, [start], wrappers)
            col = self._modality(sample, seg_index, seg, row, col)
            col = self._text(row, col, [end], wrappers)
        col = self._text(row, col, [sp.eos], wrappers)
        self.doc[row, col0:col] = doc_id
        if self.layout.mrope:
            self.positions[row, col0:col] = _mrope_positions(col0, col, self.images)
        else:
            self.positions[row, col0:col] = np.arange(col - col0)
        self.fill[row] = col
        return row, doc_id

    def _modality(self, sample: Sample, seg_index: int, seg, row: int, col: int) -> int:
        """An image / audio / image_out segment's tokens at (row, col); -> the next column."""
        lay, s = self.layout, self.layout.seq_len
        k = self.counters[seg.modality]
        self.counters[seg.modality] += 1
        n = lay.rules.segment_meta(seg.modality, seg.data.shape, seg.num_queries).num_llm_tokens
        span = slice(col, col + n)
        self.sub[row, span] = self.sub_next[row]
        self.sub_next[row] += 1
        if seg.modality == "image_out":
            gen, g = self.gen, lay.gen
            assert g is not None  # check_shapes refuses image_out without a generator
            self.bam[row, span] = lay.text_bits
            gen["gen_query"][k] = row * s + np.arange(col, col + n)
            hwc = np.ascontiguousarray(seg.data.transpose(1, 2, 0), np.float32)
            if g.pixel_side:  # the VAE unit encodes them in the step
                gen["gen_pixels"][k] = hwc
            else:
                gen["gen_latents"][k] = patchify(hwc, g.patch_size)
            noise, t = gen_noise_and_t(sample.id, seg_index, (g.num_patches, g.patch_dim),
                                       g.num_train_timesteps)
            gen["gen_noise"][k], gen["gen_t"][k], gen["gen_valid"][k] = noise, t, 1.0
        else:
            slot = lay.slot(seg.modality)
            assert slot is not None  # check_shapes refuses a modality without its encoder
            where = self.place[slot.name][k]
            # causal images (HF LLaVA) see what text sees; else their own block, both ways
            self.bam[row, span] = (lay.text_bits if slot.modality == "image"
                                   and lay.image_attention == "causal" else 1 << slot.bit)
            self.gather[slot.name][row, span] = _gather_rows(slot, self.shapes, where, n)
            if slot.merge:
                self.images.append((col,) + merged_grid(seg.data.shape[0], seg.data.shape[1], slot.patch_size,
                                                        slot.merge))
            if self.enc_out is not None:
                _put_encoder_input(slot, self.enc_out[slot.name], where, seg.data)
        return col + n

    def targets(self) -> tuple[np.ndarray, np.ndarray]:
        """Next-token targets and the float loss mask: a position is trained when the next
        token is text of the same document and marked trained."""
        doc, ok = self.doc, np.zeros(self.doc.shape, bool)
        ok[:, :-1] = ((doc[:, 1:] == doc[:, :-1]) & (doc[:, :-1] != 0) & self.is_text[:, 1:]
                      & self.trained[:, 1:])
        return (np.where(ok, np.roll(self.tokens, -1, axis=1), 0).astype(np.int32),
                ok.astype(np.float32))


def _mrope_positions(col0: int, col: int, images) -> np.ndarray:
    """M-RoPE positions [col - col0, 3] of one document (HF get_rope_index): text counts up
    by one; an image's tokens (col, rows, cols) sit on its merged grid from the current
    position, after which text resumes at current + max(rows, cols)."""
    out, cur, at = [], 0, col0
    for start, rows, cols in images:
        out.append(np.repeat(np.arange(cur, cur + start - at)[:, None], 3, 1))
        cur += start - at
        out.append(vision_token_positions(cur, rows, cols))
        cur, at = cur + max(rows, cols), start + rows * cols
    out.append(np.repeat(np.arange(cur, cur + col - at)[:, None], 3, 1))
    return np.concatenate(out)


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
        place: list[Any]
        if slot.modality == "image":
            place = pack_images(image_runs(metas, slot), cap,
                                slot.max_items if slot.queries else None)
        else:
            place = list(range(len(audio_frames(metas))))
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
        buf["patch_seg"][b, offset:offset + n] = seg
        if slot.merge:  # Qwen2-VL: HF's patch order and (c, t, py, px) features
            t = slot.feature_dim // (p * p * data.shape[2])
            chw = data.astype(np.float32).transpose(2, 0, 1)
            buf["patches"][b, offset:offset + n] = qwen_patchify(chw, p, slot.merge, t)[0]
            buf["patch_pos"][b, offset:offset + n] = patch_positions(gh, gw, slot.merge)
            return
        buf["patches"][b, offset:offset + n] = patchify(data.astype(np.float32), p)
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
