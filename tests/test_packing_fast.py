"""The O(n log n) first-fit-decreasing packers (`batch_shapes.pack_rows`, `pack_images`,
issue 41) give exactly the rows / buffers / offsets / seg ids of the frozen quadratic ones
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
def test_pack_rows_identical_to_first_fit_decreasing_reference(seed):
    rng = np.random.default_rng(seed)
    seq_len = int(rng.choice([1, 7, 64, 2048]))
    for n in (0, 1, 5, 60, 700):
        # mostly fitting, some exactly a row, some longer than a row
        hi = int(rng.choice([seq_len // 4 + 1, seq_len + 1, 2 * seq_len + 1]))
        lengths = rng.integers(1, hi + 1, n).tolist()
        for packing in ("pack", "pad"):
            assert pack_rows(lengths, seq_len, packing) == \
                reference.pack_rows_decreasing(lengths, seq_len, packing)


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


@pytest.mark.parametrize("kind", ["laion", "mix"])
@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_batch_shapes_identical_to_per_sample_reference(kind, packing):
    """Random groups (some empty, some large) of synthetic metadata, with and without a
    generator and an items-per-buffer cap: the columnar, compiled `batch_shapes` equals
    the per-sample Python one."""
    import dataclasses

    from mmjax.data.batch_shapes import batch_shapes
    from mmjax.data.layout import AssemblyLayout, GenSlot
    from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset
    from mmjax.models.config import (AudioConfig, EncoderSpec, LLMConfig, MLLMConfig,
                                     ProjectorConfig, VisionConfig)
    cfg = SyntheticConfig(image_side_median=24.0, image_side_range=(4, 64),
                          text_len_median=30.0, text_len_range=(1, 1024),
                          frames_median=300.0, frames_range=(20, 3000))
    model = MLLMConfig("t", LLMConfig(256, 32, 1, 2, 1, 64), encoders=(
        EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=cfg.patch_size),
                    ProjectorConfig(downsample=2)),
        EncoderSpec("audio", AudioConfig(16, 1, 2, 32), ProjectorConfig())))
    base = AssemblyLayout.from_config(model, 2048, packing, vision_caps=(256, 1024, 4096))
    ds = SyntheticDataset(kind, cfg, seed=3)
    pool = [ds.meta(i, base.rules) for i in range(600)]
    rng = np.random.default_rng(7)
    compared = 0
    for trial in range(8):
        layout = base
        if trial % 2:
            vision = dataclasses.replace(base.encoders[0], class_slots=int(rng.integers(1, 6)))
            layout = dataclasses.replace(base, encoders=(vision,) + base.encoders[1:],
                                         gen=GenSlot((4, 8, 8), 2, 16, 1000))
        sizes = rng.choice([0, 1, 3, 60, 400], int(rng.integers(1, 9)))
        groups = [[pool[i] for i in rng.integers(0, len(pool), k)] for k in sizes]
        try:
            want = reference.batch_shapes(groups, layout, reference.pack_rows_decreasing)
        except ValueError:  # an image larger than the largest cap: both refuse
            with pytest.raises(ValueError):
                batch_shapes(groups, layout)
            continue
        assert batch_shapes(groups, layout) == want
        compared += 1
    assert compared >= 6


def test_unit_costs_from_columns_match_the_metadata():
    """`batch_plan.unit_costs` (from `shape_columns`) gives per sample exactly the LLM
    length, each encoder's input tokens and the generated images of its SampleMeta."""
    from mmjax.data.batch_plan import unit_costs
    from mmjax.data.sample import SampleMeta, SegmentMeta
    from mmjax.models.config import (AudioConfig, EncoderSpec, LLMConfig, MLLMConfig,
                                     ProjectorConfig, VisionConfig)
    model = MLLMConfig("t", LLMConfig(256, 32, 1, 2, 1, 64), encoders=(
        EncoderSpec("vision", VisionConfig(16, 1, 2, 32, patch_size=4), ProjectorConfig()),
        EncoderSpec("audio", AudioConfig(16, 1, 2, 32), ProjectorConfig())))
    rng = np.random.default_rng(5)
    mods = ["text", "image", "audio", "image_out"]
    metas = []
    for i in range(300):
        segs = tuple(SegmentMeta(mods[int(rng.integers(4))], int(rng.integers(0, 50)),
                                 int(rng.integers(0, 900)), int(rng.integers(0, 900)), 0,
                                 int(rng.choice([0, 2])))
                     for _ in range(int(rng.integers(0, 6))))
        metas.append(SampleMeta(i, segs))
    costs = unit_costs(metas, model)
    want = reference.unit_costs(metas, model)
    assert {u: c.tolist() for u, c in costs.items()} == {u: c.tolist() for u, c in want.items()}
    assert costs["llm"].tolist() == [m.llm_length for m in metas]
    assert costs["vision"].tolist() == [m.encoder_tokens("image") for m in metas]
    assert costs["audio"].tolist() == [m.encoder_tokens("audio") for m in metas]
    assert all(c.dtype == np.float64 for c in costs.values())
    from mmjax.data.batch_plan import _NO_SLOTS
    from mmjax.data.shape_columns import shape_columns
    cols = shape_columns(metas, _NO_SLOTS)
    assert cols.image_out.tolist() == [m.count("image_out") for m in metas]
    assert unit_costs([], model)["llm"].size == 0


@pytest.mark.parametrize("seed", range(6))
def test_kernel_counts_equal_the_packer_per_group(seed):
    """`first_fit_decreasing_buffers` over many groups at once (one reused tree, sized by
    the bound on bins) opens per group exactly as many buffers as `pack_images`: empty
    groups, zero runs, runs over the cap, item caps 0 / 1 / a few / none."""
    from mmjax.data.packing_kernels import first_fit_decreasing_buffers
    rng = np.random.default_rng(300 + seed)
    cap = int(rng.choice([16, 256, 4096]))
    sizes = rng.choice([0, 1, 2, 9, 60, 700], int(rng.integers(1, 12)))
    groups = [rng.integers(0, int(rng.choice([cap // 8 + 1, cap, 2 * cap])) + 1, k)
              for k in sizes]
    runs = np.concatenate(groups + [np.zeros(0, np.int64)]).astype(np.int64)
    ends = np.cumsum(sizes).astype(np.int64)
    for max_items in (None, 0, 1, 3, 64):
        got = first_fit_decreasing_buffers(runs, ends, cap, -1 if max_items is None
                                           else max_items)
        want = [1 + max([b for b, _, _ in pack_images(g.tolist(), cap, max_items)],
                        default=-1) for g in groups]
        assert got.tolist() == want, (cap, max_items)



def _random_groups(rng):
    """Random groups for the kernel: empty, a few, many (the tree); sizes of one value,
    past the cap, past three radix passes, multiples of a downsample."""
    cap = int(rng.choice([1, 4, 255, 4096, 1 << 30]))
    sizes = rng.choice([0, 1, 2, 9, 60, 150, 700], int(rng.integers(1, 6)))
    hi = int(rng.choice([0, cap // 8 + 1, cap // 2 + 1, cap, 2 * cap, 1 << 40]))
    runs = rng.integers(0, hi + 1, int(sizes.sum())).astype(np.int64)
    if rng.random() < 0.3:
        runs = runs // 4 * 4
    return runs, np.cumsum(sizes).astype(np.int64), cap


def test_radix_sorted_kernel_counts_equal_the_packer():
    """The kernel with each group radix-sorted in place and an int scan (issue 41) opens
    per group exactly `pack_images`'s buffers on `_random_groups`, item caps none / 0 /
    1 / 3 / 64 (the frozen kernel before it: the slow test below)."""
    from mmjax.data.packing_kernels import first_fit_decreasing_buffers
    rng = np.random.default_rng(41)
    for _ in range(25):
        runs, ends, cap = _random_groups(rng)
        groups = np.split(runs, ends[:-1])
        for mi in (None, 0, 1, 3, 64):
            got = first_fit_decreasing_buffers(runs, ends, cap, -1 if mi is None else mi)
            want = [1 + max([b for b, _, _ in pack_images(g.tolist(), cap, mi)],
                            default=-1) for g in groups]
            assert got.tolist() == want, (cap, mi)


@pytest.mark.slow
def test_kernel_counts_equal_the_frozen_kernel():
    """The same kernel against the frozen one before issue 41's radix sort
    (tests/packing_kernels_reference.py; slow: compiling it takes ~20 s)."""
    import packing_kernels_reference as frozen
    from mmjax.data.packing_kernels import first_fit_decreasing_buffers
    rng = np.random.default_rng(410)
    for _ in range(200):
        runs, ends, cap = _random_groups(rng)
        for mi in (-1, 0, 1, 3, 64):
            assert np.array_equal(first_fit_decreasing_buffers(runs, ends, cap, mi),
                                  frozen.first_fit_decreasing_buffers(runs, ends, cap, mi))
