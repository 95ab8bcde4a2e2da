"""The packers as they were before issue 41 (O(n x bins)), frozen: LLM rows first fit in
order (`pack_rows`), images first fit decreasing (`pack_images`); `pack_rows_decreasing`
(rows first fit decreasing by the same quadratic scan) is what
`mmjax.data.batch_shapes.pack_rows` (O(n log n)) must reproduce exactly since issue 41;
and the per-sample `unit_costs` / `batch_shapes` they were called from. The "before"
column of scripts/bench_host_plan.py and scripts/bench_packing.py."""
from __future__ import annotations

import numpy as np
from numba import njit

from mmjax.data.packing_kernels import _find, _set


@njit(cache=True)
def _tree(n, cap):
    """A fresh leftmost-fit max tree over `n` bins at `cap` (the kernels' before they
    reused one tree across groups)."""
    size = 1
    while size < n:
        size *= 2
    tree = np.full(2 * size, -np.inf)
    tree[size:size + n] = cap
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    return tree, size


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


def pack_rows_decreasing(lengths: list[int], seq_len: int, packing: str) -> list[int]:
    """Row of each document: one per row ("pad"), or first fit decreasing by length, ties
    by order ("pack"), by the quadratic scan of `pack_images`."""
    if packing == "pad":
        return list(range(len(lengths)))
    return [b for b, _, _ in pack_images(lengths, seq_len, None)]


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


def unit_costs(metas, model) -> dict[str, np.ndarray]:
    """batch_plan.unit_costs before issue 41: a Python pass over the segments."""
    from mmjax.models.units import GENERATOR_UNIT, LLM_UNIT, has_generator
    enc_mod = {e.name: e.modality for e in model.encoders}
    mods = tuple(sorted(set(enc_mod.values())))
    llm, images_out, enc = [], [], {mod: [] for mod in mods}
    for m in metas:
        tokens, out, per_mod = 2, 0, dict.fromkeys(mods, 0)
        for seg in m.segments:
            tokens += seg.num_llm_tokens + seg.delimiters
            if seg.modality in per_mod:
                per_mod[seg.modality] += seg.num_encoder_tokens
            elif seg.modality == "image_out":
                out += 1
        llm.append(tokens)
        images_out.append(out)
        for mod in mods:
            enc[mod].append(per_mod[mod])
    cols = {LLM_UNIT: np.array(llm, dtype=np.float64)}
    if has_generator(model.unit_names):
        cols[GENERATOR_UNIT] = np.array(images_out, dtype=np.float64)
    for name, mod in enc_mod.items():
        cols[name] = np.array(enc[mod], dtype=np.float64)
    return cols


def batch_shapes(groups, layout, row_packer=pack_rows):
    """batch_shapes before issue 41: per group, per sample, the Python packers above
    (`row_packer`: `pack_rows` as then, or `pack_rows_decreasing` as now)."""
    from mmjax.data.batch_shapes import (BatchShapes, _bucket, audio_frames, image_runs,
                                         shape_bucket)
    rows = 1
    for metas in groups:
        lens = [m.llm_length for m in metas]
        rows = max(rows, (max(row_packer(lens, layout.seq_len, layout.packing)) + 1)
                   if lens else 1)
    if layout.packing == "pack":
        rows = shape_bucket(rows)
    encs = []
    for slot in layout.encoders:
        if slot.modality == "image":
            runs = [image_runs(m, slot) for m in groups]
            cap = _bucket(max([max(r) for r in runs if r] or [0]), layout.vision_caps)
            mi = slot.items_per_buffer
            nb = max([max(b for b, _, _ in pack_images(r, cap, mi)) + 1
                      for r in runs if r] or [1])
            encs.append((slot.name, shape_bucket(nb), cap))
        else:
            frames = [audio_frames(m) for m in groups]
            cap = _bucket(max([max(f) for f in frames if f] or [0]), layout.audio_frame_caps)
            encs.append((slot.name, shape_bucket(max([len(f) for f in frames] + [1])), cap))
    gen = 0
    if layout.gen is not None:
        gen = shape_bucket(max([sum(m.count("image_out") for m in metas) for metas in groups]
                               + [1]))
    return BatchShapes(rows, tuple(encs), gen)


@njit(cache=False)
def first_fit_rows(lengths, ends, cap):
    """Rows first fit in order opened per group, compiled, as `batch_shapes.rank_shapes`
    counted them before issue 41's item 2 (data/packing_kernels.py's leftmost-fit tree,
    rows in batch order): the "before" host time of scripts/bench_packing.py."""
    out = np.zeros(ends.size, np.int64)
    start = 0
    for g in range(ends.size):
        end = ends[g]
        tree, size = _tree(end - start, float(cap))
        bins = 0
        for j in range(start, end):
            need = float(lengths[j])
            b = _find(tree, size, need)
            if b < 0 or b == bins:
                b = bins
                bins += 1
            _set(tree, size, b, tree[size + b] - need)
        out[g] = bins
        start = end
    return out
