"""Records taken from a `SpecTable` (data/spec_columns.py), read lazily (no JAX):
`TableRecords` stands for the `SpecColumns` of a batch's records without gathering them,
and turns into the batch's `MetaColumns` read lazily from the table's per-record
totals and shape columns (data/table_meta.py), so a step does no per-segment work
(issue 41: host planning linear in the batch)."""
from __future__ import annotations

from functools import cached_property

import numpy as np

from mmjax.data.meta_columns import MetaColumns
from mmjax.data.sample import TokenRules
from mmjax.data.spec_columns import SpecColumns, SpecTable
from mmjax.data.table_meta import TableMetaColumns


class TableRecords:
    """The `SpecColumns` of records `items` of `table`, in that order, gathered only when
    read (`columns`); `meta_columns` gathers the table's `meta_rows` instead."""

    def __init__(self, table: SpecTable, items: np.ndarray):
        self.table, self.items = table, np.asarray(items, np.int64)
        self._columns: SpecColumns | None = None

    @cached_property
    def counts(self) -> np.ndarray:
        """Per record its segment count (gathered on first read)."""
        return self.table.counts[self.items]

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
        """`SpecColumns.meta_columns` of these records, read lazily: per-sample totals
        gathered from the table's per-record ones, per-segment fields when read
        (data/table_meta.py)."""
        return TableMetaColumns(self.table, self.items, ids, rules)


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
