"""Node-wise rearrangement (OrchMLLM §5.2.2, Algorithm 3): the MILP proves the brute-force
optimum on small cases (both objectives, several node shapes), and the pairwise-swap local
search (node_swaps.swap_improve) ends in a placement no single swap improves, never worse
than the greedy it starts from."""
import itertools

import numpy as np
import pytest

from mmjax.data.balance import node_wise_rearrange, post_balance
from mmjax.data.balance.node_swaps import swap_improve
from mmjax.data.balance.node_wise import _objective, _per_sample


def _placements(d, c):
    """Every assignment of d batches to d // c nodes, c per node (as node-per-batch)."""
    for combo in itertools.permutations(range(d)):
        node_of = np.empty(d, dtype=np.int64)
        node_of[list(combo)] = np.arange(d) // c
        yield node_of


def _instance(rng, d, per, skew):
    n = d * per
    sizes = rng.integers(1, 400, n).astype(float)
    src = rng.integers(0, d, n) if not skew else np.sort(rng.integers(0, d, n))
    return src, post_balance(sizes, d, "sum"), sizes


@pytest.mark.parametrize("include_recv", [True, False])
def test_milp_proves_the_brute_force_optimum(include_recv, capfd):
    rng = np.random.default_rng(21)
    for d, c in [(6, 2), (6, 3), (8, 4), (8, 2)]:
        for _ in range(3):
            src, batches, sizes = _instance(rng, d, 5, bool(rng.integers(0, 2)))
            s, bat, w, dd = _per_sample(src, batches, sizes, c)
            seen = {tuple(p) for p in _placements(d, c)}
            best = min(_objective(s, bat, w, dd, np.array(p), c, include_recv) for p in seen)
            info = {}
            perm = node_wise_rearrange(src, batches, sizes, c, method="milp",
                                       include_recv=include_recv, time_limit=10.0,
                                       require_optimal=True, info=info)
            assert info["milp_status"] == "optimal"
            assert info["objective"]["milp"] == pytest.approx(best)
            assert info["milp_bound"] == pytest.approx(best, rel=1e-6)
            node_of = np.asarray(perm)[np.arange(d)] // c
            assert _objective(s, bat, w, dd, node_of, c, include_recv) == pytest.approx(best)
    assert "HiGHS" not in capfd.readouterr().out  # the solver's banner is silenced


def _key(s, bat, w, d, node_of, c, include_recv):
    """(max, sum of squares) of the per-rank sends and per-batch receives: the local
    search's lexicographic objective."""
    cross = (s // c) != node_of[bat]
    send = np.bincount(s[cross], weights=w[cross], minlength=d)
    recv = np.bincount(bat[cross], weights=w[cross], minlength=d) if include_recv else 0 * send
    return max(send.max(), recv.max()), float((send ** 2).sum() + (recv ** 2).sum())


@pytest.mark.parametrize("include_recv", [True, False])
def test_swap_local_search_is_a_local_optimum_and_never_worse(include_recv):
    rng = np.random.default_rng(22)
    for d, c in [(8, 2), (12, 4), (16, 4), (24, 8), (32, 8)]:
        src, batches, sizes = _instance(rng, d, 8, False)
        s, bat, w, dd = _per_sample(src, batches, sizes, c)
        v = np.bincount(s * d + bat, weights=w, minlength=d * d).reshape(d, d)
        start = rng.permutation(np.arange(d) // c)
        got = swap_improve(v, start, c, include_recv)
        assert np.bincount(got, minlength=d // c).tolist() == [c] * (d // c)
        k = _key(s, bat, w, dd, got, c, include_recv)
        assert k[0] <= _key(s, bat, w, dd, start, c, include_recv)[0]
        for b1, b2 in itertools.combinations(range(d), 2):  # no single swap improves
            if got[b1] == got[b2]:
                continue
            other = got.copy()
            other[b1], other[b2] = got[b2], got[b1]
            k2 = _key(s, bat, w, dd, other, c, include_recv)
            assert not (k2[0] < k[0] or (k2[0] == k[0] and k2[1] < k[1] * (1 - 1e-9))), \
                (d, c, b1, b2)


def test_local_method_beats_or_ties_greedy_and_is_deterministic():
    rng = np.random.default_rng(23)
    for d in (16, 32, 64):
        x = np.round(rng.lognormal(7, 1, d * 20))
        src = np.arange(x.size) // 20
        batches = post_balance(x, d, "sum")
        info = {}
        perm = node_wise_rearrange(src, batches, x, 8, method="local", info=info)
        assert info["objective"]["local"] <= info["objective"]["greedy"]
        assert perm == node_wise_rearrange(src, batches, x, 8, method="local")
