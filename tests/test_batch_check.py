"""`--check`'s global batch (data/batch_check.py): planned from metadata, only a bounded
prefix decoded, the metadata hook (the memory check) before any decode."""
from __future__ import annotations

import numpy as np
import pytest

from mmjax.data.batch_check import check_global_batch
from mmjax.data.batch_shapes import batch_shapes, grow_shapes
from mmjax.data.loader import Loader
from mmjax.data.spec_list import meta_columns_of
from test_data_loader import CFG, LAYOUT, plan, source


class Counting:
    """A source that counts its decodes."""

    def __init__(self, inner):
        self.inner, self.loads = inner, 0

    def __len__(self):
        return len(self.inner)

    def spec(self, i):
        return self.inner.spec(i)

    def load(self, i):
        self.loads += 1
        return self.inner.load(i)


def _builder(gb):
    src = Counting(source())
    return src, Loader.build(src, CFG, plan(gb=gb, mbs=2), LAYOUT,
                                   {u: "orchmllm" for u in CFG.unit_names}, seed=1).builder


@pytest.mark.parametrize("gb,decode,decoded", [(8, 16, 8), (32, 6, 6)])
def test_check_decodes_at_most_its_bound(gb, decode, decoded):
    src, builder = _builder(gb)
    seen = []

    def hook(metas):
        seen.append((len(metas), src.loads))

    assert check_global_batch(builder, 0, decode=decode, on_metadata=hook) == decoded
    assert seen == [(gb, 0)]  # the hook saw the whole batch before anything was decoded
    assert src.loads == decoded


def test_shapes_from_columns_equal_the_object_path():
    """`grow_shapes` of the columns (the shape scan's and the memory check's) equals it of
    the `SampleMeta` objects."""
    _, builder = _builder(32)
    idx, specs, _ = builder.stream.select(0)
    metas = meta_columns_of(idx, specs, LAYOUT.rules)
    assert grow_shapes(None, metas, LAYOUT) == batch_shapes([metas.metas()], LAYOUT)
    floor = grow_shapes(None, metas.metas()[:5], LAYOUT)
    assert grow_shapes(floor, metas, LAYOUT) == grow_shapes(floor, metas.metas(), LAYOUT)
    assert np.array_equal(metas.ids, idx)
