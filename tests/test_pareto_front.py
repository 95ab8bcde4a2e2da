"""The repair's (GPUs, time) Pareto front (planner/repair.py `pareto_front`) is exactly
what sorting by (GPUs, time) -- stable, a tie by position -- and keeping each new least time
gives, on random plans with many ties in both GPUs and time."""
import numpy as np
import pytest

from mmjax.planner.repair import combine, pareto_front


def sorted_front(gpus, times):
    order = np.lexsort((times, gpus))
    g, t = gpus[order], times[order]
    keep = t < np.minimum.accumulate(np.concatenate(([np.inf], t[:-1])))
    return g[keep], t[keep], order[keep]


@pytest.mark.parametrize("seed", range(4))
def test_front_is_the_sorted_scan(seed):
    rng = np.random.default_rng(seed)
    for trial in range(500):
        k = int(rng.integers(0, 80))
        gpus = rng.integers(1, int(rng.integers(2, 40)), k).astype(float)
        times = (rng.integers(1, 12, k) * 0.25 if trial % 2 else rng.random(k))
        for want, got in zip(sorted_front(gpus, times), pareto_front(gpus, times)):
            np.testing.assert_array_equal(got, want)


def test_combine_front_by_hand():
    # unit options [gpus, stage, warm, sync]; m = 3 microbatches: time = warm + 2 stage + sync
    a = np.array([[1.0, 2.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]])
    b = np.array([[1.0, 1.0, 1.0, 0.0], [3.0, 0.5, 0.5, 0.0]])
    t, idx, (gs, ts, flats, shape) = combine([a, b], 3, 4)
    # (gpus, time): (0,0) 2, 5; (0,1) 4, 4.5; (1,0) 3, 3; (1,1) 5 > 4 GPUs
    assert (t, tuple(int(i) for i in idx)) == (3.0, (1, 0))
    assert gs.tolist() == [2.0, 3.0] and ts.tolist() == [5.0, 3.0]
    assert flats.tolist() == [0, 2] and shape == [2, 2]
