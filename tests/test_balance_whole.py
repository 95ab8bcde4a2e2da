"""The compiled whole-length paths of the post-balancing policies (data/balance/lpt_int.py:
counting sort, bucket-queue LPT; conv.py's `_conv_whole`) give exactly the batches of the
numpy implementation they replaced on token counts, copied here as the reference: the
sorted order, OrchMLLM Algorithm 1 (vectorised rounds on int64 keys) and Algorithm 5."""
import numpy as np
import pytest

from mmjax.data.balance import lpt_int, post_balance_flat
from mmjax.data.balance.conv import _conv_whole
from mmjax.data.balance.lpt import _sorted_by


# ---- the previous implementation (mmjax/data/balance/lpt.py and conv.py before lpt_int) ----

def _lpt_assign(x: np.ndarray, loads: np.ndarray, items: np.ndarray,
                counts: np.ndarray | None = None,
                xs: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Greedy: ``items`` (in the given order) each to the bin of least (load, index).

    Returns (bin, slot) per item, slot = the item's place in its bin counting from
    ``counts`` (items already there; updated in place, as ``loads`` is). Exactly the heap
    algorithm, vectorised: a chunk of items takes the next-lightest bins in order as long as
    none of them would rather go to a bin already filled in this chunk (checked per item, so
    results match the heap loop bit for bit); each chunk is usually a whole round of ``d``
    items and gives each bin at most one item, so slots are counted per chunk. Whole
    lengths (token counts) run on int64 keys (`_lpt_keys`): one plain sort per chunk
    instead of a stable argsort.
    """
    d = loads.size
    counts = np.zeros(d, dtype=np.int64) if counts is None else counts
    xs = x[items] if xs is None else xs
    if items.size and _int_keys_fit(x, loads):
        return _lpt_keys(xs, loads, counts)
    bins = np.empty(items.size, dtype=np.int64)
    slots = np.empty(items.size, dtype=np.int64)
    ranked = np.argsort(loads, kind="stable")
    i = 0
    while i < items.size:
        m = min(d, items.size - i)
        xc = xs[i:i + m]
        f = loads[ranked[:m]]
        r = 1
        if m > 1:
            ok = f[1:] < np.minimum.accumulate(f + xc)[:-1]
            r = m if ok.all() else 1 + int(np.argmin(ok))
        chosen = ranked[:r]
        bins[i:i + r] = chosen
        slots[i:i + r] = counts[chosen]
        counts[chosen] += 1
        loads[chosen] += xc[:r]
        ranked = np.argsort(loads, kind="stable")
        i += r
    return bins, slots


def _int_keys_fit(x: np.ndarray, loads: np.ndarray) -> bool:
    """Whole lengths (all of ``x``) and loads whose keys load * 2^k + bin stay below 2^62."""
    k = max(1, int(loads.size - 1).bit_length())
    top = float(loads.max()) + float(x.sum())
    return (top < 2.0 ** (62 - k) and bool(np.all(x == np.floor(x)))
            and bool(np.all(loads == np.floor(loads))))


def _lpt_keys(xs: np.ndarray, loads: np.ndarray,
              counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`_lpt_assign` on int64 keys (load << k) | bin: keys are distinct and order bins by
    (load, index), so the heap's choice is the least key. A chunk's t-th item goes to the
    t-th least key as long as that key is below every key already raised in the chunk."""
    d = loads.size
    k = max(1, int(d - 1).bit_length())
    mask = (1 << k) - 1
    keys = np.sort((loads.astype(np.int64) << k) | np.arange(d, dtype=np.int64))
    xi = xs.astype(np.int64) << k
    n = xs.size
    bins = np.empty(n, dtype=np.int64)
    slots = np.empty(n, dtype=np.int64)
    # while every bin holds the same count (a fresh start, then whole rounds), a whole
    # round's slots are that count and every bin gains one: no gather, no scatter
    even = counts.size == 0 or counts.min() == counts.max()
    i = 0
    while i < n:
        m = min(d, n - i)
        new = keys[:m] + xi[i:i + m]
        r = m
        if m > 1:
            late = np.flatnonzero(keys[1:m] > np.minimum.accumulate(new[:-1]))
            if late.size:
                r = 1 + int(late[0])
        chosen = np.bitwise_and(keys[:r], mask, out=bins[i:i + r])
        if r == d and even:
            slots[i:i + r] = counts[0]
            counts += 1
        else:
            np.take(counts, chosen, out=slots[i:i + r])
            counts[chosen] += 1
            even = even and r == d
        if r == d:
            new.sort()
            keys = new
        else:
            keys = np.sort(np.concatenate((new[:r], keys[r:])))
        i += r
    loads[keys & mask] = (keys >> k).astype(np.float64)
    return bins, slots


def _small_ints(x: np.ndarray) -> bool:
    return bool(x.size) and x.max() < 65536 and bool(np.all(x == np.floor(x)))


def _sorted_by_reference(x: np.ndarray, descending: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices by length, decreasing or increasing, ties by increasing index; the lengths
    in that order). Token counts sort as unique integer keys (length << bits of n) | index,
    uint32 where they fit: a plain sort instead of a stable argsort, and the sorted lengths
    come out of the keys without a gather."""
    n = x.size
    if not _small_ints(x):
        order = np.argsort(-x if descending else x, kind="stable")
        return order, x[order]
    xi = x.astype(np.int64)
    top = int(xi.max())
    v = top - xi if descending else xi
    ib = max(1, (n - 1).bit_length())
    dt = np.uint32 if max(1, int(v.max()).bit_length()) + ib <= 32 else np.uint64
    keys = np.sort((v.astype(dt) << dt(ib)) | np.arange(n, dtype=dt))
    vals = (keys >> dt(ib)).astype(np.float64)
    return (keys & dt((1 << ib) - 1)).astype(np.int64), (top - vals if descending else vals)



def _greedy(x, d):
    items, xs = _sorted_by_reference(x, True)
    counts = np.zeros(d, dtype=np.int64)
    bins, slots = _lpt_assign(x, np.zeros(d), items, counts, xs)
    return _place(bins, slots, items, counts)


def _place(bins, slots, items, counts):
    flat = np.empty(items.size, dtype=np.int64)
    flat[(np.cumsum(counts) - counts)[bins] + slots] = items
    return flat, counts


def _conv_reference(x: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """Algorithm 5 (ConvTransformer: padded attention, cost L + lambda * b * max^2).

    Phase 1: descending lengths packed into batches whose padded size (count * first length)
    stays within Algorithm 1's objective, at most d batches (groups similar lengths, so
    little padding). Phase 2: the remaining lengths go greedily to the batch of least sum.
    Deviation: the paper tests ``(count + 1) * s.length``; the padded size of a descending
    batch is set by its first (longest) element, which is what we use. Returns
    (samples batch after batch, count per batch).
    """
    desc, xs = _sorted_by_reference(x, True)
    lpt_loads = np.zeros(d)
    _lpt_assign(x, lpt_loads, desc, xs=xs)
    bound = float(lpt_loads.max())
    n = x.size
    v = memoryview(xs)  # Python floats, no numpy scalar per step
    ends = []
    i = 0
    while i < n and len(ends) < d:
        xi = v[i]
        j = i + int(bound // xi) if xi > 0 else n  # zero lengths: all the rest
        i = n if j > n else (i + 1 if j <= i else j)
        ends.append(i)
    ends_a = np.array(ends, dtype=np.int64)
    sizes = np.diff(ends_a, prepend=0)
    bins, slots = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    bins[:i] = np.repeat(np.arange(len(ends)), sizes)
    slots[:i] = np.arange(i) - np.repeat(ends_a - sizes, sizes)
    loads = np.bincount(bins[:i], weights=xs[:i], minlength=d)
    counts = np.zeros(d, dtype=np.int64)
    counts[:len(ends)] = sizes
    bins[i:], slots[i:] = _lpt_assign(x, loads, desc[i:], counts, xs[i:])
    return _place(bins, slots, desc, counts)


# ---- the tests ----

def _whole_cases(seed, count):
    """Token counts with many ties, zeros, one value, wide ranges; d from 1 to 300."""
    rng = np.random.default_rng(seed)
    for trial in range(count):
        d = int(rng.choice([1, 2, 3, 7, 16, 64, 300]))
        n = int(rng.integers(1, 16)) * (d if trial % 3 else 1) + int(rng.integers(0, 5))
        kind = trial % 6
        if kind == 0:
            x = rng.integers(1, 60, n)
        elif kind == 1:
            x = rng.integers(0, 4, n)  # zeros: they stay on the least bin
        elif kind == 2:
            x = np.round(rng.lognormal(7, 1, n))
        elif kind == 3:
            x = np.full(n, 5)
        elif kind == 4:
            x = rng.integers(1, 70000, n)  # beyond the old 16-bit sort
        else:
            x = np.r_[np.zeros(n // 3), rng.integers(1, 3000, n - n // 3)]
            rng.shuffle(x)
        yield x.astype(float), d


def _equal(got, want):
    return all(np.array_equal(a, b) for a, b in zip(got, want))


def test_counting_sort_is_the_stable_sort():
    for x, _ in _whole_cases(0, 60):
        for descending in (True, False):
            top = lpt_int.whole_stats(x)[0]
            got = lpt_int.counting_order(x, int(top), descending)
            assert _equal(got, _sorted_by_reference(x, descending))
            assert _equal(_sorted_by(x, descending), got)


@pytest.mark.parametrize("seed", [1, 2])
def test_bucket_lpt_and_conv_match_the_numpy_implementation(seed):
    compiled = 0
    for x, d in _whole_cases(seed, 90):
        want = _greedy(x, d)
        got = lpt_int.lpt_whole(x, d)
        if got is not None:
            compiled += 1
            assert _equal(got, want), (x.size, d)
        assert _equal(post_balance_flat(x, d, "sum"), want)
        want = _conv_reference(x, d)
        assert _equal(post_balance_flat(x, d, "conv"), want), (x.size, d)
        got = _conv_whole(x, d)
        assert got is None or _equal(got, want)
    assert compiled >= 75  # the cases run the compiled path, not only the fallback


def test_bucket_lpt_from_uneven_loads_matches_the_rounds():
    """Conv's phase 2 shape: bins start at different whole loads and counts."""
    rng = np.random.default_rng(3)
    for trial in range(80):
        d = int(rng.choice([1, 2, 5, 64, 300]))
        xs = np.sort(rng.integers(0, 200, int(rng.integers(1, 400))))[::-1].astype(float)
        loads = rng.integers(0, 500, d) * (trial % 4 != 0)
        counts = rng.integers(0, 5, d)
        want_loads, want_counts = loads.astype(float), counts.copy()
        want = _lpt_assign(xs, want_loads, np.arange(xs.size), want_counts, xs)
        got_loads, got_counts = loads.copy(), counts.copy()
        k, dtype = lpt_int.pick_bits(xs.size + 5 * d, d)
        picks = np.full(xs.size + 3, -1, dtype)
        lpt_int.lpt_buckets(lpt_int.value_counts(xs, int(xs.max())), got_loads, got_counts,
                            picks, k, 2)  # from the third pick on
        assert (picks[:2] == -1).all() and (picks[-1] == -1)
        got = picks[2:-1].astype(np.int64)
        assert _equal((got & ((1 << k) - 1), got >> k), want), trial
        np.testing.assert_array_equal(got_loads, want_loads)
        np.testing.assert_array_equal(got_counts, want_counts)


def test_at_scale_and_outside_the_compiled_range():
    """2560 ranks x 60 LAION-like samples (buckets of many bins: the bitmap order), and
    lengths the compiled path declines (huge loads, floats) still give the same batches."""
    rng = np.random.default_rng(4)
    x = np.round(rng.lognormal(7, 1, 2560 * 60))
    assert _equal(post_balance_flat(x, 2560, "sum"), _greedy(x, 2560))
    assert _equal(post_balance_flat(x, 2560, "conv"), _conv_reference(x, 2560))
    for x, d in [(np.round(rng.lognormal(16, 1, 50)), 2), (rng.random(200) * 50, 7)]:
        assert lpt_int.lpt_whole(x, d) is None
        assert _equal(post_balance_flat(x, d, "sum"), _greedy(x, d))
        assert _equal(post_balance_flat(x, d, "conv"), _conv_reference(x, d))
