"""The rewritten post-balancing policies (mmjax/data/balance/: integer-key LPT, slot
placement, snapped padded search, vectorised conv phase 1) give exactly the batches of the
previous implementation (tests/balance_reference.py), and post_balance_flat is
post_balance as arrays."""
import numpy as np
import pytest

import balance_reference as ref
from mmjax.data.balance import POLICIES, post_balance, post_balance_flat


def _cases(seed, count):
    rng = np.random.default_rng(seed)
    for trial in range(count):
        d = int(rng.choice([1, 2, 3, 7, 16, 64, 300]))
        n = int(rng.integers(1, 40)) * (d if trial % 3 else 1) + int(rng.integers(0, 5))
        kind = trial % 6
        if kind == 0:
            x = rng.integers(1, 60, n)  # many ties
        elif kind == 1:
            x = rng.integers(0, 4, n)  # zeros and ties
        elif kind == 2:
            x = np.round(rng.lognormal(7, 1, n))  # LAION-like token counts
        elif kind == 3:
            x = rng.integers(1, 70000, n)  # beyond 16 bits: the general sort
        elif kind == 4:
            x = rng.random(n) * 100  # floats: the float LPT path
        else:
            x = np.full(n, 5)
        yield x.astype(float), d


@pytest.mark.parametrize("policy", POLICIES)
def test_same_batches_as_the_previous_implementation(policy):
    for x, d in _cases(POLICIES.index(policy), 60):
        if policy == "padded" and np.any(x != np.round(x)):
            continue
        want = ref.post_balance(x, d, policy)
        assert post_balance(x, d, policy) == want, (policy, x.size, d)
        flat, counts = post_balance_flat(x, d, policy)
        assert counts.tolist() == [len(b) for b in want]
        assert flat.tolist() == [s for b in want for s in b]


def test_same_batches_at_scale():
    """1024 ranks x 60 LAION-like samples (the runs of "sum_square" and long padded
    searches), every policy."""
    rng = np.random.default_rng(11)
    x = np.round(rng.lognormal(7, 1, 1024 * 60))
    for policy in POLICIES:
        assert post_balance(x, 1024, policy) == ref.post_balance(x, 1024, policy), policy
