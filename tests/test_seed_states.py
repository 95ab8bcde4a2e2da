"""data/seed_states.py equals NumPy: `SeedSequence([seed, i, k]).generate_state(4,
np.uint64)` word for word (seeds of one, two and three uint32 words, indices up to
2**32 - 1), a generator set to `pcg64_state` draws what `default_rng([seed, i, k])`
draws, and `SyntheticDataset.specs` equals `spec` per index on both kinds."""
import numpy as np
import pytest

from mmjax.data.seed_states import pcg64_state, seed_states
from mmjax.data.synthetic import SyntheticConfig, SyntheticDataset


@pytest.mark.parametrize("seed", [0, 1, 4_000_037, (1 << 32) + 7, (1 << 70) + 3])
@pytest.mark.parametrize("k", [0, 1, 1 << 33])
def test_states_equal_numpys(seed, k):
    idx = np.concatenate([[0, 1, 2, (1 << 31), (1 << 32) - 1],
                          np.random.default_rng(seed % 1000).integers(0, 1 << 32, 40)])
    got = seed_states(seed, idx, k)
    want = np.stack([np.random.SeedSequence([seed, int(i), k]).generate_state(4, np.uint64)
                     for i in idx])
    assert np.array_equal(got, want)
    bits = np.random.PCG64(0)
    rng = np.random.Generator(bits)
    for i, w in zip(idx[:8].tolist(), got):
        bits.state = pcg64_state(w)
        ref = np.random.default_rng([seed, i, k])
        assert rng.random(3).tolist() == ref.random(3).tolist()
        assert rng.standard_normal() == ref.standard_normal()
        assert rng.geometric(0.55) == ref.geometric(0.55)


@pytest.mark.parametrize("kind", ["laion", "mix"])
def test_bulk_specs_equal_per_index(kind):
    ds = SyntheticDataset(kind, SyntheticConfig(bad_fraction=0.1, gen_fraction=0.2), seed=7)
    idx = np.random.default_rng(1).integers(0, 1 << 20, 400)
    assert ds.specs(idx) == [ds.spec(int(i)) for i in idx]
    with pytest.raises(ValueError, match="2\\*\\*32"):
        seed_states(0, np.array([-1]), 0)
