"""Static batch shapes from sample metadata only (no JAX): LLM rows (one per sample, or
first-fit-decreasing packing), encoder buffers (images first-fit-decreasing into buffers
of a bucket capacity, audio clips one per row), generated-image slots; counts rounded up to
`shape_bucket`s (at most four per octave) so jit sees few shapes (DistTrain §2.3, OrchMLLM §2.2).
"""
from __future__ import annotations

from typing import Any

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from mmjax.data.layout import AssemblyLayout, EncoderSlot, shape_bucket
from mmjax.data.packing_kernels import first_fit_decreasing_buffers
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.sample import SampleMeta
from mmjax.data.shape_columns import ShapeColumns, shape_columns


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

    def union(self, other: "BatchShapes | None") -> "BatchShapes":
        """The shape floor: field-wise max with `other` (same encoders); None is no floor."""
        if other is None:
            return self
        encs = tuple((n, max(c, other.encoder(n)[0]), max(cap, other.encoder(n)[1]))
                     for n, c, cap in self.encoders)
        return BatchShapes(max(self.rows, other.rows), encs, max(self.gen, other.gen))

    def to_json(self) -> dict:
        """As a resume state stores it: {"rows", "gen", "encoders": [[name, count, cap]]}."""
        return {"rows": self.rows, "gen": self.gen, "encoders": [list(e) for e in self.encoders]}

    @classmethod
    def from_json(cls, data: dict) -> "BatchShapes":
        return cls(int(data["rows"]), tuple((str(n), int(c), int(k))
                                            for n, c, k in data["encoders"]), int(data["gen"]))


def grow_shapes(shapes: BatchShapes | None, metas: "list[SampleMeta] | MetaColumns",
                layout: AssemblyLayout) -> BatchShapes:
    """Shapes that fit `metas` and only grow from `shapes` (a run's high-water mark): the
    need is computed at encoder capacities of at least the current ones (buffer counts
    depend on the capacity), then `union`. jit then compiles a handful of shapes per run
    instead of one per batch."""
    if shapes is not None:
        kw: dict[str, Any] = {}
        for slot in layout.encoders:
            cap = shapes.encoder(slot.name)[1]
            key = "vision_caps" if slot.modality == "image" else "audio_frame_caps"
            kw[key] = tuple(c for c in getattr(layout, key) if c >= cap)
        layout = dataclasses.replace(layout, **kw)
    if isinstance(metas, MetaColumns):  # the shape scan's columns: no objects built
        n = len(metas)
        need = rank_shapes(shape_columns(metas, layout), np.arange(n, dtype=np.int64),
                           np.array([n], np.int64), layout)
    else:
        need = batch_shapes([metas], layout)
    return need.union(shapes)


def _bucket(need: int, caps: tuple[int, ...]) -> int:
    for c in caps:
        if c >= need:
            return c
    raise ValueError(f"need capacity {need} > largest bucket {caps[-1]}")


_FULL = float("-inf")  # the key of a buffer that takes no more images (its max_items)


class LeftmostFit:
    """The leftmost bin whose key (free capacity) is at least a need, in O(log n): a max
    segment tree over `n` bins' keys, every bin starting at `init` (unopened bins hold a
    fresh bin's capacity, so the leftmost unopened one is where first fit opens a new bin).
    Makes first-fit packing O(n log n) instead of O(n x bins)."""

    def __init__(self, n: int, init):
        size = 1
        while size < n:
            size *= 2
        self.size = size
        # leaves: n bins at `init`, the padding to a power of two never fits (-inf)
        tree = [_FULL] * size + [init] * n + [_FULL] * (size - n)
        for i in range(size - 1, 0, -1):
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right
        self.tree = tree

    def find(self, need) -> int:
        """Index of the leftmost bin with key >= `need`, or -1 if none."""
        tree = self.tree
        if tree[1] < need:
            return -1
        i, size = 1, self.size
        while i < size:
            i *= 2
            if tree[i] < need:
                i += 1
        return i - size

    def set(self, bin_index: int, key) -> None:
        tree = self.tree
        i = bin_index + self.size
        tree[i] = key
        i //= 2
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            tree[i] = left if left >= right else right
            i //= 2


def pack_rows(lengths: list[int], seq_len: int, packing: str) -> list[int]:
    """Row of each document: one per row ("pad"), or first fit decreasing by length, ties
    by order ("pack": `pack_images` with rows as buffers; a document longer than a row gets
    a row of its own), O(n log n). Decreasing order packs ~1k-token documents into 2k/4k
    rows 4-6 points fuller than first fit in order (docs/packing.md); a row's documents
    still sit in batch order (assembly writes them in order)."""
    if packing == "pad":
        return list(range(len(lengths)))
    return [b for b, _, _ in pack_images(lengths, seq_len, None)]


def pack_images(runs: list[int], cap: int, max_items: int | None) -> list[tuple[int, int, int]]:
    """(buffer, patch offset, 1-based seg id) per image: first fit decreasing by run length
    (ties by order), at most `max_items` images per buffer when given; O(n log n)
    (`LeftmostFit`; a buffer holding `max_items` images takes the key -inf)."""
    order = sorted(range(len(runs)), key=lambda i: (-runs[i], i))
    fit = LeftmostFit(len(runs), cap)
    free: list[int] = []
    items: list[int] = []
    out: list[tuple[int, int, int]] = [(0, 0, 0)] * len(runs)
    for i in order:
        b = fit.find(runs[i])
        if b < 0 or b == len(free):  # no open buffer fits: open the next one
            b = len(free)
            free.append(cap)
            items.append(0)
        out[i] = (b, cap - free[b], items[b] + 1)
        free[b] -= runs[i]
        items[b] += 1
        fit.set(b, free[b] if max_items is None or items[b] < max_items else _FULL)
    return out


def image_runs(metas: list[SampleMeta], slot: EncoderSlot) -> list[int]:
    r = slot.downsample
    return [math.ceil(s.input_size / r) * r for m in metas for s in m.segments
            if s.modality == "image"]


def audio_frames(metas: list[SampleMeta]) -> list[int]:
    return [s.input_size for m in metas for s in m.segments if s.modality == "audio"]


def batch_shapes(groups: list[list[SampleMeta]], layout: AssemblyLayout) -> BatchShapes:
    """Common static shapes for several batches (e.g. all DP ranks of one microbatch, which
    must share shapes inside one SPMD program): per field the max over `groups`."""
    cols = shape_columns([m for metas in groups for m in metas], layout)
    counts = np.array([len(metas) for metas in groups], np.int64)
    return rank_shapes(cols, np.arange(int(counts.sum()), dtype=np.int64), counts, layout)


def _group_sums(x: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Sum of `x` over each group (`x[ends[g - 1]:ends[g]]`); 0 for an empty group."""
    csum = np.concatenate([[0], np.cumsum(x)])
    return csum[ends] - csum[np.concatenate([[0], ends[:-1]])]


def rank_shapes(cols: ShapeColumns, items: np.ndarray, counts: np.ndarray,
                layout: AssemblyLayout) -> BatchShapes:
    """`batch_shapes` of the groups `items[ends[g - 1]:ends[g]]` (indices into `cols`, a
    `RankSplit`'s items and counts), from the columns: the packers' row / buffer counts
    come from the compiled kernels (data/packing_kernels.py), every group in one call."""
    ends = np.cumsum(counts)
    nonempty = counts > 0
    rows = 1
    if layout.packing == "pad":
        rows = max(rows, int(counts.max(initial=0)))
    elif nonempty.any():
        per = first_fit_decreasing_buffers(cols.llm[items], ends, layout.seq_len, -1)
        rows = shape_bucket(max(rows, int(per[nonempty].max())))
    else:
        rows = shape_bucket(rows)
    encs = []
    for slot in layout.encoders:
        values, per_sample = cols.items[slot.name].take(items)
        per_group = _group_sums(per_sample, ends)
        caps = layout.vision_caps if slot.modality == "image" else layout.audio_frame_caps
        cap = _bucket(int(values.max(initial=0)), caps)
        if slot.modality == "image":
            mi = slot.items_per_buffer
            nb = 1
            if values.size:
                flat_ends = np.cumsum(per_group)
                per = first_fit_decreasing_buffers(values, flat_ends, cap,
                                                   -1 if mi is None else mi)
                nb = max(nb, int(per[per_group > 0].max()))
            encs.append((slot.name, shape_bucket(nb), cap))
        else:
            encs.append((slot.name, shape_bucket(max(int(per_group.max(initial=0)), 1)), cap))
    gen = 0
    if layout.gen is not None:
        per = _group_sums(cols.image_out[items], ends)
        gen = shape_bucket(max(int(per.max(initial=0)), 1))
    return BatchShapes(rows, tuple(encs), gen)
