"""The specs that spec columns stand for (no JAX): `SpecList`, what `SampleStream.select`
returns (each spec built only when read), and `meta_columns_of`, a batch's metadata
columns from its specs, read from the columns directly when they are a `SpecList`'s
(issue 41: host planning linear in the batch)."""
from __future__ import annotations

from collections.abc import Sequence

from mmjax.data.meta_columns import CODE, MetaColumns
from mmjax.data.sample import MODALITIES, TokenRules
from mmjax.data.spec_columns import SpecColumns
from mmjax.data.table_records import TableRecords


class SpecList(Sequence):
    """The specs that `columns` stand for (`SpecColumns`, or records of a table read
    lazily: data/table_records.py), each built when read (`spec`)."""

    def __init__(self, columns: SpecColumns | TableRecords):
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns)

    def __getitem__(self, p):  # type: ignore[override]
        if isinstance(p, slice):
            return [self.columns.spec(i) for i in range(len(self))[p]]
        if p < 0:
            p += len(self)
        if not 0 <= p < len(self):
            raise IndexError(p)
        return self.columns.spec(p)


def spec_columns(specs) -> SpecColumns | TableRecords:
    """The columns of `specs` (a `SpecList`'s own, or built from a list)."""
    return specs.columns if isinstance(specs, SpecList) else SpecColumns.from_specs(specs)


def meta_columns_of(ids, specs, rules: TokenRules) -> MetaColumns:
    """`rules.meta_from_shapes(ids[i], specs[i])` for every i, as columns. Entries are
    (modality, shape, num_queries[, num_masked]), as a source's `spec` gives them;
    `specs` may be a `SpecList` (its columns are read as they are, no spec built)."""
    cols = spec_columns(specs)
    if isinstance(cols, SpecColumns) and (cols.code < 0).any():
        m = next(e[0] for s in specs for e in s if e[0] not in CODE)
        raise ValueError(f"unknown modality {m!r}; use one of {MODALITIES}")
    return cols.meta_columns(ids, rules)
