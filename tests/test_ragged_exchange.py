"""The ragged exchange (parallel/ragged_tables.py, parallel/ragged_exchange.py), checked where
XLA:CPU cannot run it: its NumPy tables equal a row walk; `lax.ragged_all_to_all` modelled
in NumPy (tests/ragged_reference.py) with those tables delivers what the staged exchange
really delivers on the CPU devices, forward and backward; the program lowers for CUDA from
this host with one ragged all-to-all each way, buffers at the bucketed capacities, and no
other collective; `Loader.exchange` picks it on GPU only."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ragged_reference import emulate, walk_tables
from test_rearrange import _batch

from mmjax.data.colocated_layout import plan_colocated_layout
from mmjax.errors import UserError
from mmjax.parallel import rearrange as R
from mmjax.parallel.exchange_stages import bucket
from mmjax.parallel.hlo_traffic import ragged_bytes, ragged_operands
from mmjax.parallel.ragged_exchange import exchange_kind
from mmjax.parallel.ragged_tables import ragged_caps, ragged_tables

HIDDEN = 3


def _random_deliveries(rng, n: int, src_slots: int, dst_slots: int):
    """Deliveries of a random map: each filled destination (v, q) from a random (u, s)."""
    out = []
    for v in range(n):
        for q in np.flatnonzero(rng.random(dst_slots) < rng.random()):
            out.append((int(rng.integers(n)), v, int(rng.integers(src_slots)), int(q)))
    order = rng.permutation(len(out))
    return [out[k] for k in order]


def test_tables_equal_a_row_walk():
    """On 300 random maps (1-9 devices), every table equals the row walk's, and the buffers
    are the busiest device's remote rows, bucketed."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, ss, ds = int(rng.integers(1, 10)), int(rng.integers(1, 12)), int(rng.integers(1, 12))
        d = _random_deliveries(rng, n, ss, ds)
        t = ragged_tables(d, n, ss, ds)
        ref = walk_tables(d, n, ss, ds)
        for k in ("input_offsets", "send_sizes", "output_offsets", "recv_sizes", "recv"):
            np.testing.assert_array_equal(getattr(t, k), ref[k], err_msg=k)
        taken = {(int(u), int(c)): int(t.take[u, c]) for u, c in zip(*np.nonzero(t.take >= 0))}
        assert taken == ref["take"]
        far = ref["send_sizes"]
        assert t.caps == (bucket(int(far.sum(1).max(initial=0))),
                          bucket(int(far.sum(0).max(initial=0))))
        assert t.caps == ragged_caps(t.count)


def _per_device(x, mesh, axes, slots):
    """A dp-blocked global array as [devices, slots, ...] (each device its rank's block)."""
    blocks = x.reshape((-1, slots) + x.shape[1:])
    rank = np.zeros(mesh.size, np.int64)
    for r, devs in enumerate(R.rank_devices(mesh, axes)):
        rank[devs] = r
    return blocks[rank]


def _global(y, mesh, axes):
    """[devices, slots, ...] back to the dp-blocked global array (every replica agrees)."""
    reps = R.rank_devices(mesh, axes)
    for devs in reps:
        for d in devs[1:]:
            np.testing.assert_array_equal(y[d], y[devs[0]])
    return np.concatenate([y[devs[0]] for devs in reps])


CASES = [((8,), ("dp",), "dp", "dp", {"vision": "sum", "audio": "conv", "llm": "sum"}),
         ((4, 2), ("dp", "tp"), ("dp", "tp"), "dp", {"vision": 8, "audio": 8, "llm": 4}),
         ((4, 2), ("dp", "tp"), "dp", ("dp", "tp"), {"vision": 4, "audio": 8, "llm": 8})]


@pytest.mark.parametrize("shape,names,src,dst,ranks", CASES)
def test_emulated_ragged_equals_the_staged_exchange(shape, names, src, dst, ranks):
    """The ragged tables, applied by the NumPy model of the collective, deliver the rows and
    the gradients the staged exchange really delivers on 8 CPU devices (one device per rank;
    a tp-replicated LLM; a tp encoder), over 2 nodes of 4."""
    mesh = jax.make_mesh(shape, names)
    lengths, out_rows = _batch(3)
    policy = ranks if "llm" in ranks and isinstance(ranks["llm"], str) else "sum"
    counts = ranks if isinstance(ranks["llm"], int) else 8
    lay = plan_colocated_layout(lengths, out_rows, counts, policy)
    routes = lay.routes["vision"]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(routes.src_ranks * routes.src_slots, HIDDEN)).astype(np.float32)
    w = rng.normal(size=(routes.dst_ranks * routes.dst_slots, HIDDEN)).astype(np.float32)
    staged = R.device_tables(R.plan_exchange(routes, mesh, src, dst, ranks_per_node=4), mesh)
    fn = jax.jit(lambda x, t: R.exchange(x, t, mesh, src, dst))
    xd = jax.device_put(x, NamedSharding(mesh, P(src)))
    out = np.asarray(fn(xd, staged))
    grad = np.asarray(jax.jit(jax.grad(lambda x, t: (fn(x, t) * w).sum()))(xd, staged))
    plan = R.plan_exchange(routes, mesh, src, dst, kind="ragged")
    got = _global(emulate(_per_device(x, mesh, src, routes.src_slots), plan.forward), mesh, dst)
    np.testing.assert_array_equal(got, out)
    back = _global(emulate(_per_device(w, mesh, dst, routes.dst_slots), plan.backward), mesh,
                   src)
    np.testing.assert_array_equal(back, grad)


@pytest.fixture(scope="module")
def cuda_hlo():
    """The forward and gradient of a ragged exchange on the 8 CPU devices, lowered for CUDA
    (not compiled: no GPU here), as HLO text; and its plan."""
    mesh = jax.make_mesh((8,), ("dp",))
    lengths, out_rows = _batch(1)
    lay = plan_colocated_layout(lengths, out_rows, 8, "sum")
    routes = lay.routes["vision"]
    plan = R.plan_exchange(routes, mesh, "dp", "dp", kind="ragged")
    tables = R.device_tables(plan, mesh)
    x = jax.device_put(np.ones((8 * routes.src_slots, HIDDEN), np.float32),
                       NamedSharding(mesh, P("dp")))
    loss = lambda x, t: (R.exchange(x, t, mesh, "dp", "dp") ** 2).sum()
    low = jax.jit(jax.value_and_grad(loss)).trace(x, tables).lower(lowering_platforms=("cuda",))
    return low.as_text(dialect="hlo", debug_info=True), plan


def test_ragged_program_lowers_for_cuda(cuda_hlo):
    """One ragged all-to-all forward, one backward, buffers at the plan's bucketed (send,
    receive) rows, no dense all-to-all or permute: the links carry the send sizes, and the
    ledger's bytes (the real rows) fit the compiled send buffers."""
    hlo, plan = cuda_hlo
    assert "all-to-all(" not in hlo.replace("ragged-all-to-all(", "")
    assert "collective-permute" not in hlo
    fwd = ragged_operands(hlo, R.FORWARD_SCOPE)
    bwd = ragged_operands(hlo, R.BACKWARD_SCOPE)
    assert fwd == [{"dtype": "f32", "send": (plan.forward.caps[0], HIDDEN),
                    "recv": (plan.forward.caps[1], HIDDEN)}]
    assert bwd == [{"dtype": "f32", "send": (plan.backward.caps[0], HIDDEN),
                    "recv": (plan.backward.caps[1], HIDDEN)}]
    got = ragged_bytes(fwd[0], plan.forward.send_sizes, 4)  # the program's rows, the tables' sizes
    led = R.TrafficLedger(4)
    led.add(plan.forward, 4 * HIDDEN)
    assert {k: got[k] for k in led.sent} == led.sent
    assert led.sent["inter_node"] == led.payload["inter_node"] > 0
    assert led.sent["intra_node"] == led.payload["intra_node"]
    assert got["intra_node"] + got["inter_node"] <= got["bound"]
    sent_rows = plan.forward.send_sizes.sum(axis=1)
    assert sent_rows.max() <= fwd[0]["send"][0] <= 1.25 * max(sent_rows.max(), 4)


def test_exchange_kind():
    assert exchange_kind("auto", "cpu") == "staged"
    assert exchange_kind("auto", "gpu") == "staged"  # ragged opt-in until a GPU run checks it
    assert exchange_kind("staged", "gpu") == "staged"
    assert exchange_kind("ragged", "gpu") == "ragged"
    with pytest.raises(UserError, match=r"Loader.exchange='ragged' needs a GPU .*'staged'"):
        exchange_kind("ragged", "cpu")
    assert exchange_kind("auto") == "staged"


def test_the_setting_is_validated_with_its_fix():
    from mmjax.settings import SETTINGS, check

    with pytest.raises(UserError) as e:
        check("Loader.exchange", "dense", SETTINGS["Loader"]["exchange"])
    assert str(e.value).startswith("Loader.exchange='dense'") and "\n" not in str(e.value)
    assert "ragged: GPU ragged all-to-all" in str(e.value)
    for ok in ("auto", "staged", "ragged"):  # "ragged" off GPU: refused where it acts
        check("Loader.exchange", ok, SETTINGS["Loader"]["exchange"])
