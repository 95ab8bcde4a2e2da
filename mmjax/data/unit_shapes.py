"""A microbatch plan's per-unit shapes, each computed when first read (no JAX)."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from mmjax.data.batch_shapes import BatchShapes, rank_shapes
from mmjax.data.layout import AssemblyLayout
from mmjax.data.rank_split import RankSplit
from mmjax.data.shape_columns import ShapeColumns


class UnitShapes(Mapping):
    """Unit -> its common `BatchShapes` over its DP ranks, each computed when first read
    (`rank_shapes`): the loader's feeds compute their own shapes, so a plan computes only
    the ones something reads (the fill metrics, tests), not every unit's on every step."""

    def __init__(self, cols: ShapeColumns, at: np.ndarray, splits: dict[str, RankSplit],
                 layout: AssemblyLayout):
        self._cols, self._at, self._splits, self._layout = cols, at, splits, layout
        self._done: dict[str, BatchShapes] = {}

    def __getitem__(self, unit: str) -> BatchShapes:
        if unit not in self._done:
            sp = self._splits[unit]
            self._done[unit] = rank_shapes(self._cols, self._at[sp.items], sp.counts,
                                           self._layout)
        return self._done[unit]

    def __iter__(self) -> Iterator[str]:
        return iter(self._splits)

    def __len__(self) -> int:
        return len(self._splits)
