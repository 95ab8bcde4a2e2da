"""Specs as columns (data/spec_columns.py, issue 41) equal the per-sample path exactly:
`SpecColumns.usable` is `layout.check_shapes(spec) is None` on random good and broken
specs (every rule of the check hit), `take` / `SpecList` give back the specs a source
gave, `meta_columns` equals `TokenRules.meta_from_shapes`; and data/shuffle.py's
`index_shuffle` equals grain's on every block size."""
import numpy as np
import pytest
from grain.experimental import index_shuffle as grain_shuffle

from mmjax.data.layout import AssemblyLayout, check_shapes
from mmjax.data.shuffle import index_shuffle
from mmjax.data.spec_columns import SpecColumns
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.data.spec_list import SpecList, meta_columns_of
from test_meta_columns import _model, random_specs


def broken(rng, spec):
    """`spec` with one entry made wrong in one of the ways `check_shapes` names."""
    spec = list(spec)
    if not spec or rng.random() < 0.1:
        return [] if rng.random() < 0.5 else [("video", (3,), 0)]
    j = int(rng.integers(len(spec)))
    m, shape, k, *rest = spec[j]
    kind = int(rng.integers(6))
    if kind == 0:
        shape = shape + (1,)
    elif kind == 1:
        shape = (0,) + shape[1:]
    elif kind == 2:
        shape = (shape[0] + 1,) + shape[1:]
    elif kind == 3:
        shape = (shape[0] * 40,) + shape[1:]
    elif kind == 4:
        k += 1
    else:
        shape = shape[:1]
    spec[j] = (m, shape, k, *rest)
    return spec


@pytest.mark.parametrize("gen", [False, True])
def test_usable_is_check_shapes_and_columns_give_the_specs_back(gen):
    layout = AssemblyLayout.from_config(_model(gen), 1024, "pack", vision_caps=(256, 1024))
    rng = np.random.default_rng(3)
    specs = [[e if e[0] != "image_out" else ("image_out", (4, 8, 8), 16) for e in s]
             for s in random_specs(rng, 600)]
    specs = [broken(rng, s) if rng.random() < 0.4 else s for s in specs]
    cols = SpecColumns.from_specs(specs)
    want = [check_shapes(s, layout) is None for s in specs]
    assert cols.usable(layout).tolist() == want
    assert 100 < sum(want) < 500  # both kinds, every rule's failures among them
    good = [s for s, ok in zip(specs, want) if ok]
    items = np.flatnonzero(want)[::-1]
    back = SpecList(cols.take(items))
    assert list(back) == [specs[i] for i in items] and len(back) == len(items)
    assert back[-1] == specs[items[-1]] and back[1:3] == [specs[i] for i in items[1:3]]
    ids = list(range(len(good)))
    mc = meta_columns_of(ids, SpecList(cols.take(np.flatnonzero(want))),
                                layout.rules)
    assert mc.metas() == [layout.rules.meta_from_shapes(i, s) for i, s in zip(ids, good)]


def test_usable_on_synthetic_sources_with_bad_samples():
    layout = AssemblyLayout.from_config(_model(True), 256, "pack")
    for kind in ("laion", "mix"):
        ds = SyntheticDataset(kind, SyntheticConfig(bad_fraction=0.2, gen_fraction=0.2,
                                                    latent_shape=(4, 8, 8)), seed=1)
        specs = [ds.spec(i) for i in range(500)]
        want = [check_shapes(s, layout) is None for s in specs]
        assert SpecColumns.from_specs(specs).usable(layout).tolist() == want
        assert 0 < sum(want) < 500


@pytest.mark.parametrize("max_index", [0, 1, 2, 5, 255, 256, 65535, 65536, 65537,
                                       (1 << 20) - 1, 1 << 20, 10 ** 9, (1 << 40) + 3])
def test_index_shuffle_equals_grains(max_index):
    rng = np.random.default_rng(max_index % 97)
    # a tiny range walks the 16-bit cipher ~2**16 / max_index times an index: few of them
    idx = rng.integers(0, max_index + 1, 64 if max_index > 1000 else 4)
    for seed in (0, 1, 4_000_037, (1 << 32) - 1):
        want = [grain_shuffle(index=int(i), max_index=max_index, seed=seed, rounds=4)
                for i in idx]
        assert index_shuffle(idx, max_index, seed).tolist() == want
    want = [grain_shuffle(index=i, max_index=6, seed=3, rounds=6) for i in range(7)]
    assert index_shuffle(np.arange(7), 6, 3, rounds=6).tolist() == want
