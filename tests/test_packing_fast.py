"""The O(n log n) first-fit packers (`batch_shapes.pack_rows`, `pack_images`, issue 41)
give exactly the rows / buffers / offsets / seg ids of the frozen quadratic ones
(tests/packing_reference.py) on random inputs: lengths up to and beyond a row, caps,
`max_items` of 0, 1, a few and None."""
import numpy as np
import pytest

import packing_reference as reference
from mmjax.data.batch_shapes import LeftmostFit, pack_images, pack_rows


def test_leftmost_fit_matches_a_linear_scan():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 8, 33):
        keys = [10] * n
        fit = LeftmostFit(n, 10)
        for _ in range(200):
            b, k = int(rng.integers(n)), int(rng.integers(-3, 12))
            keys[b] = k
            fit.set(b, k)
            need = int(rng.integers(-2, 13))
            want = next((i for i, x in enumerate(keys) if x >= need), -1)
            assert fit.find(need) == want


@pytest.mark.parametrize("seed", range(30))
def test_pack_rows_identical_to_first_fit_reference(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.choice([1, 7, 64, 2048]))
    for n in (0, 1, 5, 60, 700):
        # mostly fitting, some exactly a row, some longer than a row
        hi = int(rng.choice([seq_len // 4 + 1, seq_len + 1, 2 * seq_len + 1]))
        lengths = rng.integers(1, hi + 1, n).tolist()
        for packing in ("pack", "pad"):
            assert pack_rows(lengths, seq_len, packing) == \
                reference.pack_rows(lengths, seq_len, packing)


@pytest.mark.parametrize("seed", range(30))
def test_pack_images_identical_to_first_fit_decreasing_reference(seed):
    rng = np.random.default_rng(100 + seed)
    cap = int(rng.choice([4, 256, 1024, 4096]))
    for n in (0, 1, 6, 60, 500):
        hi = int(rng.choice([cap // 8 + 1, cap, cap + cap // 2]))
        step = int(rng.choice([1, 4]))  # runs are multiples of the downsample
        runs = (rng.integers(0, hi // step + 1, n) * step).tolist()
        for max_items in (None, 0, 1, 2, 5, 64):
            assert pack_images(runs, cap, max_items) == \
                reference.pack_images(runs, cap, max_items), (n, cap, max_items)


def test_pack_images_many_ties_and_the_item_cap():
    runs = [4] * 37 + [0] * 5 + [64] * 3
    for max_items in (None, 1, 3, 16):
        got = pack_images(runs, 64, max_items)
        assert got == reference.pack_images(runs, 64, max_items)
    # the 64s fill three buffers; the empty runs (placed last) join those, up to 3 items each
    assert max(b for b, _, _ in pack_images(runs, 64, 3)) + 1 == 3 + -(-37 // 3)
