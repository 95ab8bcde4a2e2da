"""`SampleStream.select` over arrays (data/selection.py, issue 41) picks exactly what
the frozen one-candidate-at-a-time rule did (tests/selection_reference.py): the same
indices, specs, skip reasons (and their order) and skipped rows, on random steps of
synthetic sources with bad samples, small data sets whose windows wrap epochs, windows
that run short into replacements, unshuffled streams, row budgets, and an ArrayRecord
source (its index as columns, `spec_table`); and the error for a data set without
enough usable samples."""
import numpy as np
import pytest

import selection_reference as before
from mmjax.data.loader_settings import StreamSettings
from mmjax.data.layout import check_shapes
from mmjax.data.records import ArrayRecordSource, SyntheticSource, write_dataset
from mmjax.data.sample_stream import SampleStream
from mmjax.data.selection import first_seen

from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
from mmjax.data.spec_list import SpecList
from mmjax.errors import UserError
from test_data_loader import CFG, LAYOUT, plan, source


def _stream(src, gb=4, **settings) -> SampleStream:
    return SampleStream(src, LAYOUT, gb, StreamSettings(**settings),
                        plan(gb=gb).num_microbatches)


def _same(b, step, start=None):
    s1, s2 = [], []
    try:
        want = before.select(b, step, s1, start)
    except UserError:
        with pytest.raises(UserError):
            b.select(step, s2, start)
        return None
    got = b.select(step, s2, start)
    assert got[0] == want[0] and list(got[1]) == want[1]
    assert got[2] == want[2] and list(got[2]) == list(want[2])  # reasons, in order
    assert s1 == s2
    return got


@pytest.mark.parametrize("bad,size,reserve,shuffle", [
    (0.0, 500, None, True), (0.3, 500, None, True), (0.9, 500, 0, True),
    (0.2, 37, None, True), (0.5, 23, 1, False), (0.3, 500, 2, False)])
def test_select_equals_one_at_a_time(bad, size, reserve, shuffle):
    sc = SyntheticConfig.for_model(CFG, image_side_range=(1, 6), frames_range=(4, 120),
                                   text_len_range=(1, 24), gen_queries=2, bad_fraction=bad)
    src = SyntheticSource(SyntheticDataset("mix", sc, seed=3, size=size))
    rng = np.random.default_rng(int(bad * 10) + size)
    for gb in (8, 20):
        b = _stream(src, gb, seed=int(rng.integers(9)), reserve=reserve, shuffle=shuffle)
        for step in rng.integers(0, 50, 4).tolist():
            _same(b, step)
        _same(b, 1, start=int(rng.integers(0, 10 * size)))


@pytest.mark.parametrize("budget", [3, 6])
def test_select_with_a_row_budget_equals_one_at_a_time(budget):
    b = _stream(source(bad=0.3), 16, seed=1, row_budget=budget)
    assert sum(_same(b, step) is not None for step in range(6)) >= 3


def test_array_record_source_reads_its_index_as_columns(tmp_path):
    ds = SyntheticDataset("mix", SyntheticConfig.for_model(
        CFG, image_side_range=(1, 6), frames_range=(4, 120), text_len_range=(1, 24),
        gen_queries=2, bad_fraction=0.2), seed=0, size=60)
    path = str(tmp_path / "d.arrayrecord")
    write_dataset(path, [ds[i] for i in range(60)], CFG.encoders[0].encoder.patch_size,
                  CFG.encoders[0].encoder.max_grid)
    src = ArrayRecordSource(path)
    idx = np.array([5, 0, 59, 5])
    assert list(SpecList(src.spec_table().take(idx))) == [src.spec(i) for i in idx.tolist()]
    assert src.spec_table().usable(LAYOUT)[idx].tolist() == [
        check_shapes(src.spec(i), LAYOUT) is None for i in idx.tolist()]
    b = _stream(src, 8, seed=2)
    for step in range(4):
        _same(b, step)


def test_too_few_usable_samples_is_the_same_error():
    b = _stream(source(bad=0.999), plan().global_batch, reserve=0)
    with pytest.raises(UserError, match=r"global batch 0: only \d of \d+ samples drawn are "
                                         r"usable .*data set of 500\); see skipped.jsonl"):
        b.select(0)
    with pytest.raises(UserError, match=r"only \d of \d+ samples"):
        before.select(b, 0)


@pytest.mark.parametrize("distinct", [False, True])
def test_first_seen_by_marks_equals_by_sorting(distinct):
    """`first_seen` with marks per index (n given) equals the sorting path (n = 0)."""
    rng = np.random.default_rng(7)
    n = 5000
    for _ in range(20):
        ind = (rng.permutation(n)[:300] if distinct else rng.integers(0, n, 300))
        seen = [rng.integers(0, n, int(rng.integers(0, 200))) for _ in range(2)]
        seen = seen[:int(rng.integers(0, 3))]
        want = first_seen(ind, seen, distinct)
        got = first_seen(ind, seen, distinct, n)
        assert got.tolist() == want.tolist()
        flags = [i not in {int(x) for s in seen for x in s} and i not in ind[:k].tolist()
                 for k, i in enumerate(ind.tolist())]
        assert want.tolist() == flags
