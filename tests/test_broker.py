"""Broker (DistTrain §7): transfers between disjoint sub-meshes equal the numpy reorder."""
import itertools
import os
import random
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.parallel.broker import Broker, Routes
from mmjax.parallel.broker_rounds import (device_rounds, needed_caps, ordered_round_count,
                                          permutes, rank_rounds, round_tables, sent_rows)
from mmjax.parallel.exchange_stages import bucket
from mmjax.parallel.hlo_traffic import collective_bytes
from mmjax.parallel.mesh import stage_mesh


def meshes(src, dst):
    """src/dst = (dp, tp) or (dp, cp, tp); src on the first devices, dst right after."""
    d = jax.devices()
    ns, nd = int(np.prod(src)), int(np.prod(dst))
    sm = stage_mesh(d[:ns], src[0], src[-1], src[1] if len(src) == 3 else 1)
    dm = stage_mesh(d[ns:ns + nd], dst[0], dst[-1], dst[1] if len(dst) == 3 else 1)
    return sm, dm


def reference(routes: Routes, g: np.ndarray) -> np.ndarray:
    """The reorder written out from the pairs: dst slot (j, q) <- src slot (i, s)."""
    out = np.zeros((routes.dst_ranks * routes.dst_slots,) + g.shape[1:], g.dtype)
    for i, s, j, q in routes.pairs:
        out[j * routes.dst_slots + q] = g[i * routes.src_slots + s]
    return out


def put(g, mesh):
    return jax.device_put(g, NamedSharding(mesh, P("dp")))


def check_out(y, dst_mesh, expected):
    """Global value, output sharding, and every replica's shard equal the expected block."""
    assert y.sharding == NamedSharding(dst_mesh, P("dp"))
    np.testing.assert_array_equal(np.asarray(y), expected)
    shards = y.addressable_shards
    assert {s.device.id for s in shards} == {d.id for d in dst_mesh.devices.flat}
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), expected[s.index])


def data(n, part=(3, 2), dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((n,) + part).astype(dtype)


ORDER_CASES = [
    # (src mesh, dst mesh, parts_total)
    ((2, 1), (2, 2), 2),      # a = b, tp differs
    ((2, 2), (2, 1), 4),      # a = b, two slots each
    ((4, 1), (2, 1), 4),      # concentrate
    ((4, 1), (1, 1), 4),
    ((1, 1), (4, 1), 4),      # scatter
    ((2, 1), (4, 1), 8),
    ((2, 1), (3, 1), 6),      # non-divisible: gcd 1, lcm 6
    ((3, 1), (2, 1), 6),
    ((2, 2), (1, 2), 2),      # tp replication on both sides
    ((1, 2), (2, 1), 2),
    ((1, 2, 2), (2, 1), 2),   # cp replicas on the source
    ((2, 1), (1, 2, 2), 4),   # cp x tp replicas on the destination
]


@pytest.mark.parametrize("src,dst,parts_total", ORDER_CASES)
def test_order_preserving_equals_reference(src, dst, parts_total):
    sm, dm = meshes(src, dst)
    r = Routes.order_preserving(src[0], dst[0], parts_total)
    g = data(parts_total)
    y = Broker(sm, dm).transfer(put(g, sm), r)
    check_out(y, dm, reference(r, g))
    # Sample order kept: the global array is unchanged, only its placement moves, which is
    # what a plain device_put reshard gives (the single-process reference).
    np.testing.assert_array_equal(np.asarray(y), g)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(put(put(g, sm), dm)))


def test_order_preserving_tables():
    r = Routes.order_preserving(2, 3)
    assert (r.src_slots, r.dst_slots) == (3, 2)
    assert r.pairs == ((0, 0, 0, 0), (0, 1, 0, 1), (0, 2, 1, 0),
                       (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 2, 1))
    r = Routes.order_preserving(4, 2)  # concentrate: ranks 0,1 -> 0 and 2,3 -> 1
    assert r.pairs == ((0, 0, 0, 0), (1, 0, 0, 1), (2, 0, 1, 0), (3, 0, 1, 1))
    r = Routes.order_preserving(4, 6, 24)  # gcd 2: two independent groups
    assert {(i, j) for i, _, j, _ in r.pairs} == {(0, 0), (0, 1), (1, 1), (1, 2), (2, 3),
                                                 (2, 4), (3, 4), (3, 5)}
    with pytest.raises(ValueError, match="parts_total"):
        Routes.order_preserving(2, 3, 4)


def permutation_routes():
    """dp 3 x 2 slots -> dp 2 x 4 slots: a shuffle with destination slots left empty and a
    source slot nobody reads."""
    pairs = [(2, 1, 0, 0), (0, 0, 0, 3), (1, 1, 0, 1), (1, 0, 1, 2), (2, 0, 1, 0)]
    return Routes.from_pairs(3, 2, 2, 4, pairs)


def test_from_pairs_permutation_with_zero_fill():
    sm, dm = meshes((3, 1), (2, 2))
    r = permutation_routes()
    g = data(6, (5,), seed=1)
    y = Broker(sm, dm).transfer(put(g, sm), r)
    expected = reference(r, g)
    assert not expected[2].any() and not expected[7].any()  # the zero-filled slots
    check_out(y, dm, expected)


def test_pytree_transfer_mixed_shapes_and_dtypes():
    sm, dm = meshes((2, 2), (3, 1))
    r = Routes.order_preserving(2, 3)
    tree = {"h": data(6, (4, 3), seed=2),
            "ids": np.arange(6 * 5, dtype=np.int32).reshape(6, 5),
            "bf": data(6, (2,), seed=3).astype(jax.numpy.bfloat16)}
    b = Broker(sm, dm)
    out = b.transfer_tree(jax.tree.map(lambda a: put(a, sm), tree), r)
    assert set(out) == set(tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype
        check_out(out[k], dm, reference(r, tree[k]))
    assert len(b.tables) == 1 and len(b.programs) == 1
    assert b.transfer_tree({}, r) == {}


@pytest.mark.parametrize("src,dst,routes", [
    ((2, 1), (3, 1), Routes.order_preserving(2, 3)),
    ((2, 2), (1, 2), Routes.order_preserving(2, 1)),
    ((3, 1), (2, 2), permutation_routes()),
])
def test_inverse_round_trip(src, dst, routes):
    sm, dm = meshes(src, dst)
    g = data(routes.src_ranks * routes.src_slots, seed=4)
    y = Broker(sm, dm).transfer(put(g, sm), routes)
    back = Broker(dm, sm).transfer(y, routes.inverse())
    referenced = np.zeros(len(g), bool)
    for i, s, _, _ in routes.pairs:
        referenced[i * routes.src_slots + s] = True
    expected = np.where(referenced[:, None, None], g, 0)
    check_out(back, sm, expected)
    assert routes.inverse().inverse() == routes


def test_routes_errors():
    with pytest.raises(ValueError, match="filled twice"):
        Routes.from_pairs(1, 2, 1, 1, [(0, 0, 0, 0), (0, 1, 0, 0)])
    with pytest.raises(ValueError, match="out of range"):
        Routes.from_pairs(1, 1, 1, 1, [(0, 0, 1, 0)])
    with pytest.raises(ValueError, match="out of range"):
        Routes.from_pairs(1, 1, 1, 1, [(0, 3, 0, 0)])
    broadcast = Routes.from_pairs(1, 1, 2, 1, [(0, 0, 0, 0), (0, 0, 1, 0)])
    with pytest.raises(ValueError, match="feeds both"):
        broadcast.inverse()
    sm, dm = meshes((2, 1), (1, 1))
    with pytest.raises(ValueError, match="dp 2 -> 1"):
        Broker(sm, dm).transfer(put(data(4), sm), Routes.order_preserving(3, 1))
    with pytest.raises(ValueError, match="axis 0"):
        Broker(sm, dm).transfer(put(data(4), sm), Routes.order_preserving(2, 1))


def test_broadcast_routes_forward():
    """A source part may feed several destinations (forward only)."""
    sm, dm = meshes((1, 2), (2, 1))
    r = Routes.from_pairs(1, 1, 2, 2, [(0, 0, 0, 1), (0, 0, 1, 0)])
    g = data(1, seed=5)
    check_out(Broker(sm, dm).transfer(put(g, sm), r), dm, reference(r, g))


def test_same_mesh_identity_returns_input():
    d = jax.devices()
    m = stage_mesh(d[:4], 2, 2)
    x = put(data(4), m)
    b = Broker(m, m)
    assert b.transfer(x, Routes.order_preserving(2, 2, 4)) is x
    xr = jax.device_put(data(4), NamedSharding(m, P("dp", None, "tp")))
    check_out(b.transfer(xr, Routes.order_preserving(2, 2, 4)), m, np.asarray(xr))
    # A real reorder on the same devices goes through the permute path.
    swap = Routes.from_pairs(2, 2, 2, 2, [(1, 1, 0, 0), (0, 0, 1, 1), (1, 0, 0, 1)])
    g = data(4, seed=6)
    check_out(b.transfer(put(g, m), swap), m, reference(swap, g))


# ---- one compiled program per shape ------------------------------------------------------------
def test_new_route_map_reuses_the_compiled_program():
    """Two different route maps of the same shapes and round sizes run one compiled program,
    whose collectives are one collective permute per round that carries rows (no
    all-to-all), sending exactly the rows the rounds hold."""
    sm, dm = meshes((3, 1), (2, 2))
    b = Broker(sm, dm)
    g = data(6, (5,), seed=7)
    other = Routes.from_pairs(3, 2, 2, 4, [(0, 1, 1, 3), (2, 0, 0, 0), (1, 0, 0, 2),
                                           (0, 0, 0, 1), (2, 1, 1, 1)])
    for r in (permutation_routes(), other):
        check_out(b.transfer(put(g, sm), r), dm, reference(r, g))
    assert len(b.tables) == 2
    assert len(b.programs) == 1
    caps = b.caps[(2, 4)]
    hlo = next(iter(b.programs.values())).as_text()
    assert "all-to-all" not in hlo and "all-reduce(" not in hlo and "all-gather(" not in hlo
    assert hlo.count("collective-permute(") + hlo.count("collective-permute-start(") == sum(
        1 for c in caps if c)
    row = 5 * 4
    sent = collective_bytes(hlo, ranks_per_node=len(b.union_devices))
    assert sent["intra_node"] == row * sum(sent_rows(b.rounds, caps).values())
    # A map whose busiest pair needs more rows compiles once more; the sizes then stay, so
    # returning to the first map rebuilds its tables and reuses the larger program.
    busy = Routes.from_pairs(3, 2, 2, 4, [(0, 0, 1, 0), (0, 1, 1, 1), (2, 1, 0, 3)])
    for r in (busy, permutation_routes()):
        check_out(b.transfer(put(g, sm), r), dm, reference(r, g))
    assert b.tables[permutation_routes()].host.caps == b.caps[(2, 4)] != caps
    assert b.tables[permutation_routes()].host.capacity == 2
    assert len(b.programs) == 2


# ---- rounds and tables (host only) ------------------------------------------------------------
@pytest.mark.parametrize("a,b", [(1, 1), (4, 2), (2, 4), (3, 2), (2, 3), (4, 6), (6, 4),
                                 (5, 3), (1, 4), (4, 1)])
def test_rank_rounds_are_matchings_covering_every_pair_once(a, b):
    rounds = rank_rounds(a, b)
    assert sorted(p for r in rounds for p in r) == sorted(itertools.product(range(a), range(b)))
    for r in rounds:
        assert len({i for i, _ in r}) == len(r) == len({j for _, j in r})


def simulate_tables(routes, src_reps, dst_reps, n):
    """Run the rounds on numpy 'devices': gather, one permute per round, gather. Returns the
    rounds, their sizes and the tables."""
    rounds = device_rounds(src_reps, dst_reps)
    for rnd in rounds:  # each round a valid permutation
        assert len({u for *_, u, _ in rnd}) == len(rnd) == len({v for *_, v in rnd})
    caps = needed_caps(routes, rounds)
    t = round_tables(routes, rounds, n, caps)
    rank_of = {d: i for i, reps in enumerate(src_reps) for d in reps}
    bufs = {d: np.arange(routes.src_slots) + 100 * rank_of[d] if d in rank_of
            else np.full(routes.src_slots, -7) for d in range(n)}
    sent = {u: np.where(t.send[u] >= 0, bufs[u][np.maximum(t.send[u], 0)], -9)
            for u in range(n)}
    got = {v: np.zeros(sum(caps), int) - 5 for v in range(n)}
    for perm, o, c in permutes(rounds, caps):
        for u, v in perm:
            assert u in rank_of  # only source devices send
            got[v][o:o + c] = sent[u][o:o + c]
    outs = {v: np.where(t.recv[v] >= 0, got[v][np.maximum(t.recv[v], 0)], -1) if sum(caps)
            else np.full(routes.dst_slots, -1) for v in range(n)}
    for j, reps in enumerate(dst_reps):
        want = np.full(routes.dst_slots, -1)
        for i, s, jj, q in routes.pairs:
            if jj == j:
                want[q] = 100 * i + s
        for v in reps:
            np.testing.assert_array_equal(outs[v], want)
    return rounds, caps, t


def layout(a, ra, b, rb, overlap=0):
    """Union indices of dp ranks with ra / rb replicas; the last `overlap` source devices are
    also the first destination devices."""
    src = [list(range(i * ra, (i + 1) * ra)) for i in range(a)]
    start = a * ra - overlap
    dst = [list(range(start + j * rb, start + (j + 1) * rb)) for j in range(b)]
    return src, dst, start + b * rb


@pytest.mark.parametrize("a,ra,b,rb", [(4, 1, 1, 1), (1, 1, 4, 1), (2, 2, 1, 2), (1, 2, 2, 1),
                                       (2, 1, 3, 2), (3, 2, 2, 1), (1, 4, 4, 1), (4, 1, 1, 4),
                                       (4, 1, 6, 1), (6, 2, 4, 1), (8, 1, 2, 2)])
def test_order_preserving_sends_only_the_rows_each_pair_moves(a, ra, b, rb):
    """DistTrain's gcd groups: an ordered transfer uses only the rounds of the ordered pairs
    (within the groups), each round's pairs carry the same rows, so each device sends
    exactly its pairs' rows (bucketed: <= 25% over), never the n * C of an all-to-all."""
    for parts in (a * b // np.gcd(a, b), 4 * a * b):
        r = Routes.order_preserving(a, b, parts)
        src, dst, n = layout(a, ra, b, rb)
        rounds, caps, t = simulate_tables(r, src, dst, n)
        groups = {(i, j) for i, _, j, _ in r.pairs}
        g = np.gcd(a, b)
        assert all((i * g) // a == (j * g) // b for i, j in groups)  # within a gcd group
        for rnd, cap in zip(rounds, caps):
            if cap:
                assert {(i, j) for i, j, _, _ in rnd} <= groups
        sent = sent_rows(rounds, caps)
        for u in range(n):
            want = sum(bucket(int(c)) for v, c in enumerate(t.count[u]) if v != u and c)
            assert sent.get(u, 0) == want, (u, sent, t.count[u])
        assert sum(sent.values()) <= 1.25 * t.count.sum()


def test_random_routes_and_overlapping_meshes():
    rng = random.Random(0)
    for trial in range(60):
        a, b = rng.randint(1, 4), rng.randint(1, 4)
        ps, pr = rng.randint(1, 3), rng.randint(1, 3)
        dsts = rng.sample(list(itertools.product(range(b), range(pr))), rng.randint(0, b * pr))
        srcs = [(rng.randrange(a), rng.randrange(ps)) for _ in dsts]
        r = Routes.from_pairs(a, ps, b, pr, [s + d for s, d in zip(srcs, dsts)])
        ra, rb = rng.randint(1, 2), rng.randint(1, 2)
        src, dst, n = layout(a, ra, b, rb, overlap=rng.randint(0, min(a * ra, b * rb)))
        rounds, caps, t = simulate_tables(r, src, dst, n)
        assert t.count.sum() == len(r.pairs) * rb
        # a rearranged map's rounds share one size (a stream of maps grows it a few times)
        cut = ordered_round_count(a, b) * rb
        shared = needed_caps(r, rounds, cut)
        assert shared[:cut] == caps[:cut] and len(set(shared[cut:])) <= 1
        assert all(x >= y for x, y in zip(shared, caps))
        # larger sizes (a later map's) hold the same map
        round_tables(r, rounds, n, tuple(c + rng.randint(0, 2) for c in caps))


def test_local_copies_send_nothing():
    """A destination device that already holds the source rank copies locally (same devices,
    a reorder within each rank): every delivery is to itself, nothing crosses a link."""
    reps = [[0, 1], [2, 3]]
    r = Routes.from_pairs(2, 2, 2, 2, [(0, 1, 0, 0), (0, 0, 0, 1), (1, 1, 1, 0)])
    rounds, caps, t = simulate_tables(r, reps, [[1, 0], [3, 2]], 4)
    assert all(u == v for u, v in zip(*np.nonzero(t.count)))
    assert sent_rows(rounds, caps) == {}


# ---- two processes ------------------------------------------------------------------------
_TWO_PROCESS = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(sys.argv[2], num_processes=2, process_id=int(sys.argv[1]))
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from mmjax.parallel.broker import Broker, Routes
    from mmjax.parallel.mesh import stage_mesh
    d = jax.devices()
    ok = True
    def run(src, dst, r):
        global ok
        g = np.arange(r.src_ranks * r.src_slots * 3, dtype=np.float32).reshape(-1, 3)
        x = jax.make_array_from_callback(g.shape, NamedSharding(src, P("dp")),
                                         lambda i: g[i], dtype=g.dtype)
        y = Broker(src, dst).transfer(x, r, wait=True)
        want = r.apply(g)
        ok &= all(np.array_equal(np.asarray(s.data), want[s.index]) for s in y.addressable_shards)
        back = Broker(dst, src).transfer(y, r.inverse())
        ok &= all(np.array_equal(np.asarray(s.data), g[s.index]) for s in back.addressable_shards)
    run(stage_mesh(d[:4], 2, 2), stage_mesh(d[4:7], 3, 1), Routes.order_preserving(2, 3))
    run(stage_mesh(d[2:6], 4, 1), stage_mesh([d[0], d[6]], 1, 2), Routes.order_preserving(4, 1))
    print("OK" if ok else "MISMATCH", flush=True)
    jax.distributed.shutdown()
""")


@pytest.mark.slow
def test_two_process_transfer(tmp_path, gloo_jobs):
    """Meshes in different processes (2 x 4 CPU devices, jax.distributed on localhost)."""
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    script = tmp_path / "two_process.py"
    script.write_text(_TWO_PROCESS)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(script), str(p), f"localhost:{port}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for p in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("two-process broker run timed out")
    for p, out in zip(procs, outs):
        assert p.returncode == 0 and "OK" in out, out[-3000:]


def test_ledger_counts_the_parts_each_device_delivers():
    """With a ledger set, an exchange adds per (sender, receiver) device the bytes of the
    parts it delivers: here dp 2 x tp 2 -> dp 1 x tp 2, order preserving: each destination
    replica receives both source ranks' parts (a 4x3 float32 and 5 int32 each), each from
    the sender `deliveries` picks; without a ledger nothing is counted."""
    sm, dm = meshes((2, 2), (1, 2))
    r = Routes.order_preserving(2, 1)
    tree = {"h": put(data(2, (4, 3)), sm), "ids": put(np.zeros((2, 5), np.int32), sm)}
    b = Broker(sm, dm)
    b.transfer_tree(tree, r)
    assert b.ledger is None
    b.ledger = {}
    b.transfer_tree(tree, r)
    b.transfer_tree(tree, r)
    part = 4 * 3 * 4 + 5 * 4  # bytes of one slot of every leaf
    u = [d.id for d in b.union_devices]
    want = {}
    count = b.tables[r].host.count
    for a, v in zip(*np.nonzero(count)):
        want[(u[a], u[v])] = want.get((u[a], u[v]), 0) + 2 * part * int(count[a, v])
    assert b.ledger == want
    assert sum(want.values()) == 2 * part * 2 * 2  # 2 parts to each of 2 replicas, twice
    assert {d.id for d in dm.devices.flat} == {v for _, v in want}
