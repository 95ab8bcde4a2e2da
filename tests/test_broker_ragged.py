"""The broker's ragged form (`Broker(exchange="ragged")`, GPU), checked where XLA:CPU cannot run
it: its tables, applied by the NumPy model of `lax.ragged_all_to_all`
(tests/ragged_reference.py), deliver what the staged broker really delivers between CPU
sub-meshes; its program lowers for CUDA with one ragged all-to-all per leaf at the bucketed
buffers and no other collective."""
import numpy as np
import pytest
from ragged_reference import emulate
from test_broker import data, meshes, put, reference

from mmjax.parallel.broker import Broker, Routes
from mmjax.parallel.exchange_stages import bucket
from mmjax.parallel.hlo_traffic import ragged_operands


def _random_routes(rng, a, src_slots, b, dst_slots):
    pairs = [(int(rng.integers(a)), int(rng.integers(src_slots)), j, q)
             for j in range(b) for q in range(dst_slots) if rng.random() < 0.8]
    return Routes.from_pairs(a, src_slots, b, dst_slots, pairs)


def _emulated(broker: Broker, routes: Routes, g: np.ndarray) -> np.ndarray:
    """The ragged broker's transfer of g on the union devices, by the NumPy model."""
    t = broker._tables(routes).host
    n = len(broker.union_devices)
    xs = np.zeros((n, routes.src_slots) + g.shape[1:], g.dtype)
    blocks = g.reshape((broker.a, routes.src_slots) + g.shape[1:])
    for i, reps in enumerate(broker.src_replicas):
        xs[reps] = blocks[i]
    ys = emulate(xs, t)
    for reps in broker.dst_replicas:  # every replica gets its rank's block
        for v in reps[1:]:
            np.testing.assert_array_equal(ys[v], ys[reps[0]])
    return np.concatenate([ys[reps[0]] for reps in broker.dst_replicas])


@pytest.mark.parametrize("src,dst", [((2, 1), (3, 1)), ((4, 1), (2, 2)), ((2, 2), (4, 1))])
def test_ragged_broker_equals_the_staged_broker(src, dst):
    """Order-preserving and random maps (zero fill, fan-out): the emulated ragged transfer
    equals the staged broker's real one and the reference reorder."""
    sm, dm = meshes(src, dst)
    staged, ragged = Broker(sm, dm), Broker(sm, dm, exchange="ragged")
    rng = np.random.default_rng(sum(src) * 10 + sum(dst))
    maps = [Routes.order_preserving(src[0], dst[0]),
            _random_routes(rng, src[0], 3, dst[0], 4), _random_routes(rng, src[0], 2, dst[0], 5)]
    for routes in maps:
        g = data(src[0] * routes.src_slots, seed=len(routes.pairs))
        want = np.asarray(staged.transfer(put(g, sm), routes))
        np.testing.assert_array_equal(want, reference(routes, g))
        np.testing.assert_array_equal(_emulated(ragged, routes, g), want)


def test_ragged_broker_lowers_for_cuda():
    sm, dm = meshes((2, 1), (3, 2))
    b = Broker(sm, dm, exchange="ragged")
    routes = Routes.order_preserving(2, 3)
    g = data(2 * routes.src_slots)
    t = b._tables(routes)
    ins = [b._to_union(put(g, sm), routes.src_slots), b._to_union(put(g[:, :1], sm),
                                                                   routes.src_slots)]
    hlo = b.lowered(ins, t, ("cuda",)).as_text(dialect="hlo", debug_info=True)
    assert "collective-permute" not in hlo
    assert "all-to-all(" not in hlo.replace("ragged-all-to-all(", "")
    got = ragged_operands(hlo, "broker")
    caps = t.host.caps
    assert sorted(got, key=lambda r: r["send"]) == [
        {"dtype": "f32", "send": (caps[0], 1, 2), "recv": (caps[1], 1, 2)},
        {"dtype": "f32", "send": (caps[0], 3, 2), "recv": (caps[1], 3, 2)}]
    far = t.host.send_sizes
    assert caps == (bucket(int(far.sum(1).max())), bucket(int(far.sum(0).max()))) != (0, 0)
