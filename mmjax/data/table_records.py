"""Records taken from a `SpecTable` (data/spec_columns.py), read lazily (no JAX):
`TableRecords` stands for the `SpecColumns` of a batch's records without gathering them,
and turns into the batch's `MetaColumns` by one gather of the table's per-segment
metadata, computed once per `TokenRules` (`SpecTable.meta_rows`), so a step does no
per-segment arithmetic (issue 41: host planning linear in the batch)."""
from __future__ import annotations

import numpy as np
from numba import njit

from mmjax.data.meta_columns import MODALITIES, TEXT, MetaColumns
from mmjax.data.sample import TokenRules
from mmjax.data.spec_columns import SpecColumns, SpecTable


class TableRecords:
    """The `SpecColumns` of records `items` of `table`, in that order, gathered only when
    read (`columns`); `meta_columns` gathers the table's `meta_rows` instead."""

    def __init__(self, table: SpecTable, items: np.ndarray):
        self.table, self.items = table, np.asarray(items, np.int64)
        self.counts = table.counts[self.items]
        self._columns: SpecColumns | None = None

    def __len__(self) -> int:
        return int(self.items.size)

    @property
    def columns(self) -> SpecColumns:
        if self._columns is None:
            self._columns = self.table.take(self.items)
        return self._columns

    def take(self, sub) -> "TableRecords":
        return TableRecords(self.table, self.items[np.asarray(sub, np.int64)])

    def spec(self, p: int) -> list:
        return self.table.columns.spec(int(self.items[p]))

    def meta_columns(self, ids, rules: TokenRules) -> MetaColumns:
        """`SpecColumns.meta_columns` of these records: one gather, no arithmetic."""
        rows, delimiter = self.table.meta_rows(rules)
        code = np.empty(int(self.counts.sum()), np.int8)
        f = np.empty((5, code.size), np.int64)
        _gather_meta(rows, self.table.starts, self.counts, self.items, TEXT, delimiter,
                     code, f)
        if (code < 0).any():  # as `SpecColumns.meta_columns` (columns keep no name)
            raise ValueError(f"unknown modality; use one of {MODALITIES}")
        return MetaColumns(np.asarray(ids, np.int64).reshape(len(self)), self.counts, code,
                           f[0], f[1], f[2], f[3], f[4])


def concat_records(parts: "list[SpecColumns | TableRecords]") -> "SpecColumns | TableRecords":
    """The parts one after another: `TableRecords` of one table stay lazy."""
    if len(parts) == 1:
        return parts[0]
    tables = {id(p.table) for p in parts if isinstance(p, TableRecords)}
    if len(tables) == 1 and all(isinstance(p, TableRecords) for p in parts):
        first = parts[0]
        assert isinstance(first, TableRecords)
        return TableRecords(first.table, np.concatenate([p.items for p in parts
                                                         if isinstance(p, TableRecords)]))
    return SpecColumns.concat([p.columns if isinstance(p, TableRecords) else p
                               for p in parts])


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
