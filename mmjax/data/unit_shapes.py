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
    the ones something reads (the fill metrics, tests), not every unit's on every step.
    An encoder unit whose samples carry no item of its modality (LAION-like samples on
    the audio unit) gets the shapes of an empty batch, not its samples' packed LLM rows:
    what it reads of them, its own slot, is the same either way (docs/packing.md)."""

    def __init__(self, cols: ShapeColumns, at: np.ndarray, splits: dict[str, RankSplit],
                 layout: AssemblyLayout):
        self._cols, self._at, self._splits, self._layout = cols, at, splits, layout
        self._done: dict[str, BatchShapes] = {}

    def __getitem__(self, unit: str) -> BatchShapes:
        if unit not in self._done:
            sp = self._splits[unit]
            at = self._at[sp.items]
            counts = sp.counts
            items = self._cols.items.get(unit)
            if items is not None and not items.counts[at].any():  # nothing for this unit
                at, counts = at[:0], np.zeros_like(counts)
            self._done[unit] = rank_shapes(self._cols, at, counts, self._layout)
        return self._done[unit]

    def __iter__(self) -> Iterator[str]:
        return iter(self._splits)

    def __len__(self) -> int:
        return len(self._splits)
