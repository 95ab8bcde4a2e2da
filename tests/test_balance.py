"""OrchMLLM post-balancing (OrchMLLM §5.1, App. A) vs exhaustive optima, node-wise
rearrangement (§5.2.2) vs identity and brute force, rearrangement composition (§6)."""

import heapq
import itertools

import numpy as np
import pytest

from mmjax.data.balance import (POLICIES, Rearrangement, batch_cost, batches_by_rank,
                                compose_rearrangement, greedy_partition, inter_node_volumes,
                                max_inter_node_volume, node_wise_rearrange, post_balance,
                                rearrangement, volume_matrix)
from mmjax.data.balance.sum_square import _sum_square
from mmjax.data.balance.sum_square import _sum_square_flat
from mmjax.data.balance.sum_square_int import sum_square_int


def _all_partitions(n, d):
    """Every assignment of n samples to d ranks, as an (d^n, n) array."""
    return np.array(list(itertools.product(range(d), repeat=n)))


def _opt(x, d, policy):
    """Brute-force optimum of max-over-ranks cost ("sum" or "padded") over all d^n partitions."""
    x = np.asarray(x, dtype=float)
    a = _all_partitions(len(x), d)
    costs = []
    for r in range(d):
        on = a == r
        if policy == "sum":
            costs.append((on * x).sum(axis=1))
        else:
            costs.append(on.sum(axis=1) * np.where(on, x, 0.0).max(axis=1))
    return float(np.max(costs, axis=0).min())


def _max_cost(x, batches, policy, lam=0.0):
    x = np.asarray(x, dtype=float)
    return max(batch_cost(x[b], policy, lam) for b in batches)


def _valid(batches, n, d):
    assert len(batches) == d
    assert sorted(i for b in batches for i in b) == list(range(n))


def _instances(seed, count, n_max=9):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(3, n_max + 1))
        d = int(rng.integers(2, 4))
        if d == 3 and n > 8:
            n = 8  # keep 3^n small
        yield rng.integers(1, 60, n).tolist(), d


def test_sum_within_4_3_of_exhaustive_optimum():
    for x, d in _instances(0, 25):
        b = post_balance(x, d, "sum")
        _valid(b, len(x), d)
        assert _max_cost(x, b, "sum") <= (4 / 3 - 1 / (3 * d)) * _opt(x, d, "sum") + 1e-9


def test_padded_is_exactly_optimal():
    """Some optimal padded partition is contiguous in sorted order and Algorithm 2's binary
    search finds the least feasible bound, so it must match brute force exactly."""
    for x, d in _instances(1, 25):
        b = post_balance(x, d, "padded")
        _valid(b, len(x), d)
        assert _max_cost(x, b, "padded") == _opt(x, d, "padded"), (x, d, b)


@pytest.mark.parametrize("policy", POLICIES)
def test_zero_lengths(policy):
    """Samples without a phase's modality have length 0 (e.g. text-only in an encoder)."""
    rng = np.random.default_rng(11)
    for _ in range(8):
        x = (rng.integers(0, 30, 8) * (rng.random(8) < 0.5)).tolist()
        b = post_balance(x, 2, policy)
        _valid(b, 8, 2)
        if policy in ("sum", "padded"):
            bound = 1.0 if policy == "padded" else 4 / 3 - 1 / 6
            assert _max_cost(x, b, policy) <= bound * _opt(x, 2, policy) + 1e-9
    _valid(post_balance([0, 0, 0], 2, policy), 3, 2)


def test_sum_square_bounds():
    """Tolerance 0 is Algorithm 1. Otherwise each sample joins a batch whose sum is below
    the lightest + v <= total/d + v, so max sum <= OPT_sum + v + max length (Graham-style)."""
    for x, d in _instances(2, 20):
        assert post_balance(x, d, "sum_square", tolerance=0) == post_balance(x, d, "sum")
        opt = _opt(x, d, "sum")
        for tol in (5.0, 30.0, None):
            b = post_balance(x, d, "sum_square", tolerance=tol)
            _valid(b, len(x), d)
            v = np.mean(x) if tol is None else tol
            assert _max_cost(x, b, "sum") <= opt + v + max(x) + 1e-9


def _scan_sum_square(x, d, tol):
    """The literal O(n d) scan of Algorithm 4."""
    x = np.asarray(x, dtype=float)
    sums, squares = np.zeros(d), np.zeros(d)
    out = [[] for _ in range(d)]
    for s in sorted(range(len(x)), key=lambda i: (-x[i], i)):
        near = sums < sums.min() + tol
        b = int(np.argmin(np.where(near, squares, np.inf)))
        out[b].append(s)
        sums[b] += x[s]
        squares[b] += x[s] * x[s]
    return out


def test_sum_square_heap_matches_scan_reference():
    """The O(n log d) heap version against the literal O(n d) scan of Algorithm 4."""
    scan = _scan_sum_square
    rng = np.random.default_rng(13)
    for n, d, tol in [(200, 8, 30.0), (500, 37, 5.0), (300, 16, 1e9), (100, 4, 0.5),
                      (400, 64, 100.0)]:
        x = rng.integers(1, 60, n).tolist()
        assert post_balance(x, d, "sum_square", tolerance=tol) == scan(x, d, tol)
    # the compiled heap vs scan: ties (few distinct lengths), zeros, floats, windows from tiny
    # to everything
    for trial in range(150):
        n, d = int(rng.integers(1, 250)), int(rng.integers(1, 40))
        x = [rng.integers(1, 60, n), rng.integers(0, 4, n), rng.random(n) * 100,
             np.round(rng.lognormal(3, 1, n)), rng.choice([0.1, 0.2, 0.3, 7.7], n)][trial % 5]
        x = x.astype(float)
        tol = float(rng.choice([0.5, 5.0, 30.0, x.mean(), 1e9, 0.1 + 0.2]))
        want = scan(x, d, tol)
        assert _sum_square(x, d, tol) == want, (trial, n, d, tol)


def test_sum_square_whole_lengths_path_matches_float_kernel_and_scan():
    """Whole lengths take the integer kernel (`sum_square_int`): the same batches as the
    float kernel and the literal scan, on ties, zeros, all-equal lengths, d = 1, n < d,
    tolerances from tiny (below 2^-8: the float kernel) to past every sum; and past the
    integer path's limits (long lengths, huge sums), where it steps aside."""
    rng = np.random.default_rng(17)
    taken, tried = 0, 0
    for trial in range(240):
        n = int(rng.integers(1, 300))
        d = int(rng.choice([1, 2, 3, 5, 16, 64, 333, n + 3]))
        x = [rng.integers(1, 60, n), rng.integers(0, 4, n), np.full(n, 7),
             np.round(rng.lognormal(5, 1, n)), rng.choice([0, 1, 100, 1000], n),
             np.zeros(n), rng.integers(0, 2, n) * 5_000_000][trial % 7].astype(float)
        mean = float(x.mean())
        tol = float(rng.choice([0.001, 0.004, 0.3, 1.0, 2.5, 7.0, mean, 3 * mean + 1, 1e12]))
        if tol <= 0:
            continue
        taken += sum_square_int(x, d, tol) is not None
        tried += 1
        got = _sum_square_flat(x, d, tol)
        slow = _sum_square_flat(x, d, tol, whole=False)
        assert all(np.array_equal(a, b) for a, b in zip(got, slow)), (trial, n, d, tol)
        if n * d <= 20000:
            want = _scan_sum_square(x, d, tol)
            assert _sum_square(x, d, tol) == want, (trial, n, d, tol)
    assert 150 < taken < tried  # most cases ran the integer kernel, some the float one


def test_sum_square_whole_lengths_at_scale():
    """2560 ranks x 60 LAION-like token counts: integer kernel = float kernel."""
    rng = np.random.default_rng(5)
    x = np.round(rng.lognormal(7, 1, 2560 * 60))
    for tol in (float(x.mean()), 1.0, 40000.0):
        got = _sum_square_flat(x, 2560, tol)
        slow = _sum_square_flat(x, 2560, tol, whole=False)
        assert all(np.array_equal(a, b) for a, b in zip(got, slow)), tol


@pytest.mark.slow
def test_sum_square_matches_the_previous_implementation_at_scale():
    """2560 ranks x 60 samples (OrchMLLM Table 2 scale): the compiled heap and the frozen
    pre-rewrite implementation (its vectorised runs and its Python heap loop) agree."""
    import balance_reference as old

    rng = np.random.default_rng(4)
    x = np.round(rng.lognormal(7, 1, 2560 * 60))
    tol = float(x.mean())
    got = _sum_square(x, 2560, tol)
    assert got == old._sum_square(x, 2560, tol, runs_min_ranks=1)
    assert got == old._sum_square(x, 2560, tol, runs_min_ranks=10**9)


def test_sum_square_trades_linear_for_quadratic_balance():
    # Same sums either way; tie-breaking by square-sum pairs a long with short ones.
    x = [10, 10, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2]
    lam = 0.05
    plain = _max_cost(x, post_balance(x, 2, "sum"), "sum_square", lam)
    tuned = _max_cost(x, post_balance(x, 2, "sum_square", tolerance=6), "sum_square", lam)
    assert tuned <= plain


def test_conv_bounds_and_padding_gain():
    """Phase-1 batches stay within Algorithm 1's objective; a phase-2 sample joins the
    lightest batch, so max sum <= max(Alg. 1 objective, total/d + max length)."""
    gains = []
    for x, d in _instances(3, 20):
        b = post_balance(x, d, "conv")
        _valid(b, len(x), d)
        alg1 = _max_cost(x, post_balance(x, d, "sum"), "sum")
        assert _max_cost(x, b, "sum") <= max(alg1, sum(x) / d + max(x)) + 1e-9
    rng = np.random.default_rng(4)
    for _ in range(30):  # padded-attention cost at realistic sizes: conv vs plain greedy
        x = rng.lognormal(5, 0.8, 64).round().tolist()
        lam = 1.0 / np.mean(x)
        gains.append(_max_cost(x, post_balance(x, 8, "sum"), "conv", lam)
                     / _max_cost(x, post_balance(x, 8, "conv"), "conv", lam))
    assert np.mean(gains) > 1.0


@pytest.mark.parametrize("policy", POLICIES)
def test_deterministic_exact_rank_count_and_empty_inputs(policy):
    x = np.random.default_rng(5).integers(1, 5, 200)  # many ties
    a = post_balance(x, 16, policy)
    assert a == post_balance(x.tolist(), 16, policy)
    _valid(a, 200, 16)
    _valid(post_balance(x[:3], 8, policy), 3, 8)  # fewer samples than ranks
    assert post_balance([], 4, policy) == [[], [], [], []]


def test_vectorised_greedy_matches_heap_reference():
    def heap_lpt(x, d):
        h = [(0.0, r) for r in range(d)]
        out = [[] for _ in range(d)]
        for i in sorted(range(len(x)), key=lambda i: (-x[i], i)):
            load, r = h[0]
            out[r].append(i)
            heapq.heapreplace(h, (load + x[i], r))
        return out

    rng = np.random.default_rng(6)
    for n, d, kind in [(500, 7, "int"), (3000, 64, "lognormal"), (2000, 300, "int"),
                       (100, 100, "lognormal"), (50, 3, "zeros")]:
        if kind == "int":
            x = rng.integers(0, 20, n).astype(float).tolist()
        elif kind == "zeros":
            x = [0.0] * 20 + rng.integers(1, 3, n - 20).astype(float).tolist()
        else:
            x = rng.lognormal(5, 1, n).tolist()
        assert greedy_partition(x, d) == heap_lpt(x, d)


def test_post_balance_errors():
    with pytest.raises(ValueError, match="policy"):
        post_balance([1, 2], 2, "max")
    with pytest.raises(ValueError, match="num_ranks"):
        post_balance([1, 2], 0)
    with pytest.raises(ValueError, match="lengths"):
        post_balance([1, float("nan")], 2)
    with pytest.raises(ValueError, match="integer lengths"):
        post_balance([1.5, 2.0], 2, "padded")
    with pytest.raises(ValueError, match="tolerance"):
        post_balance([1, 2], 2, "sum_square", tolerance=-1)


# ------------------------------------------------------------------ node-wise rearrangement


def test_inter_node_volumes_table():
    # 4 ranks, 2 per node. Sample sizes 1, 2, 4, 8, 16.
    src = [0, 0, 1, 2, 3]
    dst = [1, 2, 3, 2, 0]
    send, recv = inter_node_volumes(src, dst, [1, 2, 4, 8, 16], 2)
    assert send.tolist() == [2, 4, 0, 16]  # 0->1 intra, 0->2, 1->3, 2->2 stays, 3->0
    assert recv.tolist() == [16, 0, 2, 4]
    assert max_inter_node_volume(src, dst, [1, 2, 4, 8, 16], 2) == 16
    assert max_inter_node_volume(src, dst, [1, 2, 4, 8, 16], 2, include_recv=False) == 16


def test_volume_matrix_table():
    # Samples: (src rank, new batch, size) = (0,1,1) (0,0,2) (1,1,4) (1,1,8).
    v = volume_matrix([0, 0, 1, 1], [[1], [0, 2, 3]], [1, 2, 4, 8])
    assert v.tolist() == [[2, 1], [0, 12]]


def _volume(src, batches, perm, sizes, c):
    dst = np.empty(len(src), dtype=int)
    for i, b in enumerate(batches):
        dst[b] = perm[i]
    return max_inter_node_volume(src, dst, sizes, c)


def _random_instance(rng, d, per_rank, skew):
    n = d * per_rank
    src = np.repeat(np.arange(d), per_rank)
    sizes = rng.lognormal(4, 1, n).round() + 1
    if skew:  # balanced batch i mostly holds samples of a rank on another node
        c = 4
        shift = (np.arange(d) + c) % d
        batches = [list(np.where(src == shift[i])[0]) for i in range(d)]
    else:
        batches = post_balance(sizes, d, "sum")
    return src, batches, sizes


@pytest.mark.parametrize("method", ["milp", "greedy"])
def test_node_wise_never_increases_and_reduces_skew(method):
    rng = np.random.default_rng(7)
    c = 4
    for d, skew in [(8, False), (16, False), (8, True), (16, True), (32, True)]:
        src, batches, sizes = _random_instance(rng, d, 6, skew)
        perm = node_wise_rearrange(src, batches, sizes, c, method=method)
        assert sorted(perm) == list(range(d))
        before = _volume(src, batches, list(range(d)), sizes, c)
        after = _volume(src, batches, perm, sizes, c)
        assert after <= before + 1e-9
        if skew:
            assert after < before
            assert after == 0  # every batch can go back to its samples' node


def test_node_wise_milp_matches_brute_force():
    rng = np.random.default_rng(8)
    c = 2
    for _ in range(6):
        d = 6
        n = 18
        src = rng.integers(0, d, n)
        sizes = rng.integers(1, 30, n).astype(float)
        batches = post_balance(sizes, d, "sum")
        perm = node_wise_rearrange(src, batches, sizes, c, method="milp")
        best = min(_volume(src, batches, list(p), sizes, c)
                   for p in itertools.permutations(range(d)))
        assert _volume(src, batches, perm, sizes, c) == pytest.approx(best)


def test_node_wise_keeps_batches_in_place_when_possible_and_validates():
    src = [0, 1, 2, 3]
    batches = [[0], [1], [2], [3]]
    assert node_wise_rearrange(src, batches, [5, 5, 5, 5], 2) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        node_wise_rearrange([0, 1, 2], [[0], [1], [2]], [1, 1, 1], 2)
    with pytest.raises(ValueError, match="exactly once"):
        node_wise_rearrange([0, 1], [[0], [0]], [1, 1], 1)
    with pytest.raises(ValueError, match="method"):
        node_wise_rearrange(src, batches, [1] * 4, 2, method="ilp")
    assert batches_by_rank([[7], [8], [9]], [2, 0, 1]) == [[8], [9], [7]]


# ------------------------------------------------------------------ composition


def _random_batches(rng, samples, d):
    s = rng.permutation(samples).tolist()
    cuts = np.sort(rng.integers(0, len(s) + 1, d - 1))
    return [list(map(int, part)) for part in np.split(np.array(s, dtype=int), cuts)]


def test_rearrangement_apply_inverse_then_round_trip():
    rng = np.random.default_rng(9)
    for _ in range(10):
        n, d = int(rng.integers(1, 30)), int(rng.integers(1, 6))
        a, b = _random_batches(rng, range(n), d), _random_batches(rng, range(n), d + 1)
        r = rearrangement(a, b)
        assert r.apply(a) == b  # payload = sample id lands exactly where b wants it
        assert r.inverse().apply(r.apply(a)) == a
        assert r.then(r.inverse()).apply(a) == a
        c = _random_batches(rng, range(n), 2)
        assert r.then(rearrangement(b, c)).apply(a) == c


def test_compose_equals_reset_then_llm_rearrangement():
    """Pi_M o Pi_E^-1 moves each encoder output to the same place as going back to the
    original instance first (the two-all-to-all path of OrchMLLM §6)."""
    rng = np.random.default_rng(10)
    n, d = 40, 4
    original = _random_batches(rng, range(n), d)
    has_image = {s for s in range(n) if rng.random() < 0.6}
    has_audio = {s for s in range(n) if rng.random() < 0.3}
    lengths = rng.integers(1, 100, n)
    llm = post_balance(lengths, d, "sum")
    enc = {}
    for name, members in (("vision", has_image), ("audio", has_audio)):
        ids = sorted(members)
        enc[name] = [[ids[i] for i in b] for b in post_balance(lengths[ids], d, "sum")]
    composed = compose_rearrangement(enc, llm)
    for name, members in (("vision", has_image), ("audio", has_audio)):
        orig_m = [[s for s in b if s in members] for b in original]
        llm_m = [[s for s in b if s in members] for b in llm]
        pi_e = rearrangement(orig_m, enc[name])
        pi_m = rearrangement(orig_m, llm_m)
        two_step = pi_e.inverse().then(pi_m)
        outputs = [[("feat", s) for s in b] for b in enc[name]]
        got = composed[name].apply(outputs)
        assert got == two_step.apply(outputs)
        assert got == [[("feat", s) for s in b] for b in llm_m]
        assert composed[name].inverse().apply(got) == outputs  # backward pass
    assert isinstance(composed["vision"], Rearrangement)


def test_compose_errors_name_the_encoder():
    with pytest.raises(ValueError, match="vision.*missing"):
        compose_rearrangement({"vision": [[0, 5]]}, [[0, 1]])
    with pytest.raises(ValueError, match="twice"):
        rearrangement([[0, 0]], [[0]])
