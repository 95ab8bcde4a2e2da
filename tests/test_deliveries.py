"""Which replica sends each part (parallel/deliveries.py, NumPy): equal, delivery for delivery,
to the per-row walk it replaced (tests/ragged_reference.py) on random maps and replica
layouts: one replica per rank, tp-replicated sources and destinations, and source and
destination sharing devices (the co-located mesh, the broker's overlapping sub-meshes)."""
import numpy as np
from ragged_reference import walk_deliveries

from mmjax.data.routes import Routes
from mmjax.parallel.deliveries import deliveries_array


def _partition(rng, devices: np.ndarray, ranks: int) -> list[list[int]]:
    """`devices` cut into `ranks` non-empty groups of random sizes, in random order."""
    cuts = np.sort(rng.choice(np.arange(1, len(devices)), ranks - 1, replace=False))
    return [g.tolist() for g in np.split(rng.permutation(devices), cuts)]


def _case(rng):
    n = int(rng.integers(1, 13))
    a, b = int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1))
    if rng.random() < 0.3:  # one replica each, no devices beyond them
        src = [[k] for k in rng.permutation(n)[:a]]
    else:
        src = _partition(rng, rng.permutation(n)[:max(a, int(rng.integers(a, n + 1)))], a)
    dst = _partition(rng, rng.permutation(n)[:max(b, int(rng.integers(b, n + 1)))], b)
    ss, ds = int(rng.integers(1, 6)), int(rng.integers(1, 6))
    pairs = [(int(rng.integers(a)), int(rng.integers(ss)), j, q)
             for j in range(b) for q in range(ds) if rng.random() < rng.random()]
    return Routes.from_pairs(a, ss, b, ds, pairs), src, dst


def test_deliveries_equal_the_row_walk():
    rng = np.random.default_rng(0)
    multi = 0
    for _ in range(500):
        routes, src, dst = _case(rng)
        got = deliveries_array(routes, src, dst)
        assert got.shape == (len(walk_deliveries(routes, src, dst)), 4)
        assert [tuple(x) for x in got.tolist()] == walk_deliveries(routes, src, dst)
        multi += any(len(r) > 1 for r in src) and len(routes.pairs) > 0
    assert multi > 150  # the greedy choices were exercised
