"""Sources' specs as flat columns (no JAX): `SpecColumns` holds (modality, shape,
num_queries[, num_masked]) entries of many samples as arrays, so the loader checks which
candidates are usable (`usable`, `layout.check_shapes` over arrays) and turns them into
metadata (`meta_columns`) without one Python object per sample; `SpecTable` is a data
set's whole index so (a source's `spec_table()`), from which a batch's rows are gathered
(issue 41: host planning linear in the batch). data/spec_list.py has the list of specs
such columns stand for."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter

import numpy as np
from numba import njit

from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import AUDIO, CODE, IMAGE, IMAGE_OUT, TEXT, MetaColumns
from mmjax.data.meta_columns import segment_fields
from mmjax.data.sample import MODALITIES, TokenRules
from mmjax.data.shape_columns import RecordShapes, shape_columns

DIMS = 3  # shape entries kept; a longer shape fits no modality (`usable` is False)


@dataclass(frozen=True, eq=False)
class SpecColumns:
    """Per sample its segment count; per segment (sample after sample) its modality code
    (`CODE`, -1 for an unknown modality), its shape's length and first `DIMS` entries (0
    past its length), num_queries, num_masked (0 when absent) and whether the entry has
    a num_masked field at all."""

    counts: np.ndarray  # int64 [samples]
    code: np.ndarray  # int8 [segments]
    ndim: np.ndarray  # int64 [segments]
    dims: np.ndarray  # int64 [segments, DIMS]
    queries: np.ndarray  # int64 [segments]
    masked: np.ndarray  # int64 [segments]
    fourth: np.ndarray  # bool [segments]

    def __len__(self) -> int:
        return int(self.counts.size)

    @cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts

    @classmethod
    def from_specs(cls, specs) -> "SpecColumns":
        """The columns of a list of specs (one list pass per field)."""
        flat = [e for s in specs for e in s]
        k = len(flat)
        code = np.fromiter((CODE.get(m, -1) for m in map(itemgetter(0), flat)), np.int8, k)
        shapes = list(map(itemgetter(1), flat))
        ndim = np.fromiter(map(len, shapes), np.int64, k)
        dims = np.zeros((k, DIMS), np.int64)
        for d in range(DIMS):
            at = np.flatnonzero(ndim > d)
            if at.size == k:
                dims[:, d] = np.fromiter(map(itemgetter(d), shapes), np.int64, k)
            elif at.size:
                dims[at, d] = [shapes[i][d] for i in at.tolist()]
        queries = np.fromiter(map(itemgetter(2), flat), np.int64, k)
        fourth = np.fromiter(map(len, flat), np.int64, k) > 3
        masked = np.zeros(k, np.int64)
        long = np.flatnonzero(fourth)
        masked[long] = [flat[i][3] for i in long.tolist()]
        return cls(np.fromiter(map(len, specs), np.int64, len(specs)), code, ndim, dims,
                   queries, masked, fourth)

    def take(self, items) -> "SpecColumns":
        """The columns of samples `items` (an index array), in that order."""
        items = np.asarray(items, np.int64)
        counts = self.counts[items]
        seg = _segments(self.starts, counts, items)
        return SpecColumns(counts, self.code[seg], self.ndim[seg], self.dims[seg],
                           self.queries[seg], self.masked[seg], self.fourth[seg])

    @staticmethod
    def concat(parts: "list[SpecColumns]") -> "SpecColumns":
        if len(parts) == 1:
            return parts[0]
        return SpecColumns(*(np.concatenate([getattr(p, f) for p in parts]) for f in
                             ("counts", "code", "ndim", "dims", "queries", "masked",
                              "fourth")))

    def spec(self, p: int) -> list:
        """Sample `p`'s spec, as its source gave it (modalities known, shapes <= DIMS)."""
        s = int(self.starts[p])
        out = []
        for j in range(s, s + int(self.counts[p])):
            shape = tuple(self.dims[j, :int(self.ndim[j])].tolist())
            e = (MODALITIES[int(self.code[j])], shape, int(self.queries[j]))
            out.append(e + (int(self.masked[j]),) if self.fourth[j] else e)
        return out

    def meta_columns(self, ids, rules: TokenRules) -> MetaColumns:
        """`spec_list.meta_columns_of(ids, these specs, rules)`."""
        if (self.code < 0).any():
            raise ValueError(f"unknown modality; use one of {MODALITIES}")
        d = self.dims
        return MetaColumns(np.asarray(ids, np.int64).reshape(len(self)), self.counts,
                           self.code, *segment_fields(rules, self.code, d[:, 0], d[:, 1],
                                                      d[:, 2], self.queries, self.masked))

    def usable(self, layout: AssemblyLayout) -> np.ndarray:
        """Per sample whether `layout.check_shapes` finds nothing wrong with it (never
        True where it would: the loader asks it for the reason of every False)."""
        ok = _segments_ok(self, layout)
        # lengths as text where a segment is already wrong (its sample is not fine anyway)
        code = np.where(ok, self.code, TEXT).astype(np.int8)
        d = self.dims
        llm, _, _, _, delim = segment_fields(layout.rules, code, d[:, 0], d[:, 1], d[:, 2],
                                             self.queries, self.masked)
        ends = np.cumsum(self.counts)
        bad = np.concatenate([[0], np.cumsum(~ok, dtype=np.int64)])
        tokens = np.concatenate([[0], np.cumsum(llm + delim, dtype=np.int64)])
        fine = (bad[ends] == bad[ends - self.counts]) & (self.counts > 0)
        return fine & (2 + tokens[ends] - tokens[ends - self.counts] <= layout.seq_len)


def _segments_ok(c: SpecColumns, layout: AssemblyLayout) -> np.ndarray:
    """Per segment whether `check_shapes`'s per-segment rules pass."""
    d0, d1, d2 = c.dims[:, 0], c.dims[:, 1], c.dims[:, 2]
    ok = (c.code == TEXT) & (c.ndim == 1) & (d0 != 0)
    g = layout.gen
    if g is not None and len(g.data_shape) == DIMS:
        same = (c.ndim == DIMS) & (c.dims == np.asarray(g.data_shape, np.int64)).all(1)
        ok |= (c.code == IMAGE_OUT) & same & (c.queries == g.num_queries)
    vis = layout.slot("image")
    if vis is not None:
        p, unit, r = vis.patch_size, vis.patch_size * max(vis.merge, 1), vis.downsample
        n = (d0 // p) * (d1 // p)
        ok |= ((c.code == IMAGE) & (c.ndim == 3) & (d2 == 3) & (d0 > 0) & (d1 > 0)
               & (d0 % unit == 0) & (d1 % unit == 0) & (d0 % p == 0) & (d1 % p == 0)
               & (np.maximum(d0, d1) // p <= vis.max_grid)
               & (-(-n // r) * r <= layout.vision_caps[-1]))
    aud = layout.slot("audio")
    if aud is not None:
        ok |= ((c.code == AUDIO) & (c.ndim == 2) & (d1 == aud.feature_dim) & (d0 > 0)
               & (d0 <= layout.audio_frame_caps[-1]))
    return ok


@njit(cache=True)
def _segments(starts, counts, items):
    """The segment indices of samples `items` (their counts `counts`), one after another."""
    out = np.empty(counts.sum(), np.int64)
    j = 0
    for k in range(items.size):
        s = starts[items[k]]
        for t in range(counts[k]):
            out[j] = s + t
            j += 1
    return out


class SpecTable:
    """A data set's whole index as columns, one row of `FIELDS` per segment (a gather
    reads one cache line per segment), built once per source: `take` gathers a batch's
    samples, `usable` is `SpecColumns.usable` of every record, computed once per layout
    (issue 41: a global batch's selection reads its candidates' rows, nothing per
    sample)."""

    def __init__(self, cols: SpecColumns):
        self.columns, self.counts, self.starts = cols, cols.counts, cols.starts
        # rows of code + 1 + 8 * ndim (at most 7) + 64 * fourth, d0, d1, d2, queries,
        # masked: int16 (12 bytes a segment), int32 or int64, what every value fits
        packed = [cols.code.astype(np.int64) + 1 + 8 * np.minimum(cols.ndim, 7)
                  + 64 * cols.fourth,
                  *cols.dims.T, cols.queries, cols.masked]
        self.rows = _narrow_rows(packed)
        self._usable: dict[AssemblyLayout, np.ndarray] = {}
        self._meta: dict[TokenRules, tuple[np.ndarray, int]] = {}
        self._totals: dict[TokenRules, np.ndarray] = {}
        self._shapes: dict[tuple, RecordShapes] = {}

    @classmethod
    def from_specs(cls, specs) -> "SpecTable":
        return cls(SpecColumns.from_specs(specs))

    def __len__(self) -> int:
        return int(self.counts.size)

    def take(self, items) -> SpecColumns:
        """`SpecColumns` of records `items` (an index array), in that order (exact for
        records of known modalities and shapes of at most `DIMS` entries: the usable)."""
        items = np.asarray(items, np.int64)
        counts = self.counts[items]
        f = _gather_rows(self.rows, self.starts, counts, items)
        head = f[0].astype(np.int64)
        return SpecColumns(counts, ((head & 7) - 1).astype(np.int8),
                           (head >> 3) & 7, f[1:4].T.astype(np.int64),
                           f[4].astype(np.int64), f[5].astype(np.int64), head >= 64)

    def usable(self, layout: AssemblyLayout) -> np.ndarray:
        """Per record `SpecColumns.usable` under `layout` (computed on first use)."""
        if layout not in self._usable:
            self._usable[layout] = self.columns.usable(layout)
        return self._usable[layout]

    def meta_rows(self, rules: TokenRules) -> tuple[np.ndarray, int]:
        """(per segment `meta_columns`'s modality code, LLM tokens, encoder tokens, input
        size, masked as rows of the narrowest int type all fit; the delimiter tokens of a
        non-text segment) of every record under `rules` (computed on first use), so a
        batch's metadata is one gather (data/table_records.py)."""
        if rules not in self._meta:
            c, d = self.columns, self.columns.dims
            llm, enc, size, masked, _ = segment_fields(rules, c.code, d[:, 0], d[:, 1],
                                                       d[:, 2], c.queries, c.masked)
            self._meta[rules] = (_narrow_rows([c.code.astype(np.int64), llm, enc, size,
                                              masked]), 2 if rules.markers else 0)
        return self._meta[rules]

    @cached_property
    def unknown_records(self) -> np.ndarray:
        """The records with a segment of an unknown modality (a batch of one is refused)."""
        bad = np.concatenate([[0], np.cumsum(self.columns.code < 0, dtype=np.int64)])
        ends = np.cumsum(self.counts)
        return np.flatnonzero(bad[ends] > bad[ends - self.counts])

    def record_meta(self, rules: TokenRules) -> MetaColumns:
        """Every record's `MetaColumns` (ids its index) from `meta_rows` (not kept: the
        per-record tables below are); an unknown modality counts as text here (a batch
        holding one is refused: `unknown_records`)."""
        rows, delimiter = self.meta_rows(rules)
        code = rows[:, 0].astype(np.int8)
        code[code < 0] = TEXT
        f = [rows[:, k].astype(np.int64) for k in range(1, 5)]
        return MetaColumns(np.arange(len(self), dtype=np.int64), self.counts, code, f[0], f[1],
                           f[2], f[3], np.where(code == TEXT, 0, delimiter).astype(np.int64))

    def record_totals(self, rules: TokenRules) -> np.ndarray:
        """Per record (rows) its `MetaColumns.llm_length`, `num_targets` and `count` of
        each of `MODALITIES`, in the narrowest int type they fit (computed on first use):
        a batch's per-sample totals are one gather."""
        if rules not in self._totals:
            mc = self.record_meta(rules)
            self._totals[rules] = _narrow_rows([mc.llm_length, mc.num_targets,
                                                *(mc.count(m) for m in MODALITIES)])
        return self._totals[rules]

    def record_shapes(self, layout: AssemblyLayout, modalities: tuple[str, ...]
                      ) -> RecordShapes:
        """`shape_columns` of every record under `layout` (computed on first use): a
        batch's are `take` of these (`TableMetaColumns.record_shapes`)."""
        slots = tuple((s.name, s.modality, s.downsample) for s in layout.encoders)
        tokens = tuple(sorted(set(modalities) | {s.modality for s in layout.encoders}))
        key = (layout.rules, slots, tokens)  # what the columns depend on (not the caps)
        if key not in self._shapes:
            self._shapes[key] = RecordShapes(shape_columns(self.record_meta(layout.rules),
                                                           layout, tokens))
        return self._shapes[key]


def _narrow_rows(packed: list[np.ndarray]) -> np.ndarray:
    """The columns `packed` as contiguous rows of the narrowest of int16, int32, int64
    that holds every value (a random gather's cost is the cache lines it reads)."""
    stacked = np.stack(packed, 1)
    lo, hi = (int(stacked.min(initial=0)), int(stacked.max(initial=0)))
    for t in (np.int16, np.int32):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return np.ascontiguousarray(stacked.astype(t))
    return np.ascontiguousarray(stacked)


@njit(cache=True)
def _gather_rows(rows, starts, counts, items):
    """[fields, segments] of the segment rows of records `items`, one after another."""
    out = np.empty((rows.shape[1], counts.sum()), rows.dtype)
    j = 0
    for k in range(items.size):
        s = starts[items[k]]
        for t in range(counts[k]):
            for f in range(rows.shape[1]):
                out[f, j] = rows[s + t, f]
            j += 1
    return out
