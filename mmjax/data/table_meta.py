"""The `MetaColumns` of records of a `SpecTable` (data/spec_columns.py), read lazily (no
JAX): planning reads per-sample totals and shape columns, which the table holds per
record (`record_totals`, `record_shapes`, computed once per rules / layout), so a step
gathers one row per sample, not one per segment; the per-segment fields are gathered
only when read (issue 41: host planning linear in the batch)."""
from __future__ import annotations

from functools import cached_property

import numpy as np
from numba import njit

from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import CODE, MODALITIES, TEXT, MetaColumns
from mmjax.data.sample import SampleMeta, SegmentMeta, TokenRules
from mmjax.data.shape_columns import ShapeColumns
from mmjax.data.spec_columns import SpecTable

_LLM_LENGTH, _TARGETS, _COUNTS = 0, 1, 2  # `SpecTable.record_totals` columns


class TableMetaColumns(MetaColumns):
    """`MetaColumns` of records `items` of `table` under `rules` (what
    `SpecColumns.meta_columns` of their gathered columns gives, field for field): the
    per-sample totals are gathered at once (an unknown modality is refused then), the
    per-segment fields on first read."""

    _table: SpecTable
    _items: np.ndarray
    _rules: TokenRules
    _ids: object  # the ids as given (a list, as `select` returns them): read when needed

    @cached_property
    def ids(self) -> np.ndarray:
        return np.asarray(self._ids, np.int64).reshape(self._items.size)

    @cached_property
    def counts(self) -> np.ndarray:
        return self._table.counts[self._items]

    def __len__(self) -> int:
        return int(self._items.size)

    def __init__(self, table: SpecTable, items: np.ndarray, ids, rules: TokenRules):
        for name, value in (("_table", table), ("_items", items), ("_rules", rules),
                            ("_ids", ids)):
            object.__setattr__(self, name, value)  # the fields stay frozen
        bad = table.unknown_records
        if bad.size and np.isin(items, bad).any():  # as `SpecColumns.meta_columns`
            raise ValueError(f"unknown modality; use one of {MODALITIES}")

    def record_shapes(self, layout: AssemblyLayout,
                      modalities: tuple[str, ...]) -> ShapeColumns | None:
        if layout.rules != self._rules:
            return None
        return self._table.record_shapes(layout, modalities).take(self._items)

    @cached_property
    def _totals(self) -> np.ndarray:
        return self._table.record_totals(self._rules)[self._items]

    def _total(self, k: int) -> np.ndarray:
        return self._totals[:, k].astype(np.int64)

    @property
    def llm_length(self) -> np.ndarray:
        return self._total(_LLM_LENGTH)

    @property
    def num_targets(self) -> np.ndarray:
        return self._total(_TARGETS)

    def count(self, modality: str) -> np.ndarray:
        return self._total(_COUNTS + CODE[modality])

    def meta(self, p: int) -> SampleMeta:
        """Sample `p`'s `SampleMeta`, from its record's rows (nothing else gathered)."""
        rows, delimiter = self._table.meta_rows(self._rules)
        s = int(self._table.starts[int(self._items[p])])
        return SampleMeta(int(self.ids[p]), tuple(
            SegmentMeta(MODALITIES[c], llm, enc, size, masked,
                        0 if c == TEXT else delimiter)
            for c, llm, enc, size, masked in rows[s:s + int(self.counts[p])].tolist()))

    @cached_property
    def _segments(self) -> tuple[np.ndarray, np.ndarray]:
        rows, delimiter = self._table.meta_rows(self._rules)
        code = np.empty(int(self.counts.sum()), np.int8)
        f = np.empty((5, code.size), np.int64)
        _gather_meta(rows, self._table.starts, self.counts, self._items, TEXT, delimiter,
                     code, f)
        return code, f

    @cached_property
    def modality(self) -> np.ndarray:
        return self._segments[0]

    @cached_property
    def llm_tokens(self) -> np.ndarray:
        return self._segments[1][0]

    @cached_property
    def encoder_tokens(self) -> np.ndarray:
        return self._segments[1][1]

    @cached_property
    def input_size(self) -> np.ndarray:
        return self._segments[1][2]

    @cached_property
    def masked(self) -> np.ndarray:
        return self._segments[1][3]

    @cached_property
    def delimiters(self) -> np.ndarray:
        return self._segments[1][4]


@njit(cache=True)
def _gather_meta(rows, starts, counts, items, text, delimiter, code, out):
    """Into `code` and `out` ([llm, encoder, size, masked, delimiters] x segments): the
    meta rows of records `items`, one after another, widened as they are written."""
    j = 0
    for k in range(items.size):
        s = starts[items[k]]
        for t in range(counts[k]):
            c = rows[s + t, 0]
            code[j] = c
            for f in range(4):
                out[f, j] = rows[s + t, f + 1]
            out[4, j] = 0 if c == text else delimiter
            j += 1
