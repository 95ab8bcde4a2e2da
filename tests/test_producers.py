"""Preprocessing producers (DistTrain §4.2; data/producer.py, data/producer_pool.py): the
trainer receives the same global batches with 0, 1 or 3 local producers, a remote (loopback)
producer, across a producer killed mid-run, and from a resumed state."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from mmjax.data.loader import Loader
from mmjax.errors import UserError
from tests.test_data_loader import CFG, LAYOUT, SCAN, digest, plan, source

KW = dict(balance="orchmllm", seed=3, reserve=8, shape_scan_steps=SCAN)
STEPS = 8


def loader(**kw):
    return Loader.build(source(bad=0.2), CFG, plan(), LAYOUT, **KW, **kw)


@pytest.fixture(scope="module")
def reference():
    ld = loader()
    out = [digest(next(ld)) for _ in range(STEPS)]  # digests hold each batch's skip count
    ld.close()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_remote(port: int):
    """`python -m mmjax.data.producer --listen=127.0.0.1:PORT`, as on a CPU host."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-m", "mmjax.data.producer",
                             f"--listen=127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True,
                            env=env, cwd=root)
    assert proc.stdout.readline().startswith("mmjax producer listening on tcp://127.0.0.1:")
    return proc


def test_settings_are_checked_before_any_work():
    with pytest.raises(UserError, match="producer_addresses"):
        loader(producer_addresses=["nohost"])
    with pytest.raises(UserError, match="producers replace grain workers"):
        loader(producers=1, num_workers=1)
    with pytest.raises(UserError, match="producers=-1"):
        loader(producers=-1)


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 3])
def test_local_producers_give_the_same_batches(reference, n):
    ld = loader(producers=n)
    assert [digest(next(ld)) for _ in range(STEPS)] == reference
    ld.close()


@pytest.mark.slow
def test_killed_local_producer_is_restarted_and_resume_is_exact(reference):
    ld = loader(producers=2)
    got = [digest(next(ld)) for _ in range(2)]
    os.kill(ld._it.producers[0].proc.pid, signal.SIGKILL)
    got += [digest(next(ld)) for _ in range(5)]  # step 6 is asked of it after the kill
    assert ld._it.restarts == 1
    state = ld.get_state()
    assert state["step"] == 7 and len(state["producers"]) == 2
    ld.close()
    assert got == reference[:7]
    again = loader(producers=1)  # a restarted trainer, another producer count
    again.set_state(state)
    assert [digest(next(again)) for _ in range(1)] == reference[7:]
    again.close()


@pytest.mark.slow
def test_remote_producer_and_its_loss(reference):
    port = _free_port()
    remote = start_remote(port)
    try:
        ld = loader(producer_addresses=[f"127.0.0.1:{port}"])
        assert [digest(next(ld)) for _ in range(3)] == reference[:3]
        ld.close()
        # a trainer restart reconnects to the same producer (a new session)
        ld = loader(producer_addresses=[f"127.0.0.1:{port}"], producers=1)
        ld.set_state({"step": 1})
        got = [digest(next(ld)) for _ in range(2)]
        remote.kill()
        remote.wait()
        # its share goes to the local one (step 7, its own, is asked for after the kill)
        got += [digest(next(ld)) for _ in range(5)]
        assert got == reference[1:8]
        assert ld._it.reassigned >= 1 and not ld._it.producers[1].alive
        ld.close()
    finally:
        remote.kill()
        remote.wait()


@pytest.mark.slow
def test_single_program_batches_with_a_producer():
    import numpy as np

    from mmjax.data.batch_shapes import grow_shapes
    from mmjax.train.single_data import LoaderBatches

    def grow(shapes, metas):  # the single program's rule
        return grow_shapes(shapes, metas, LAYOUT)

    def batches(**kw):
        import gin
        with gin.unlock_config():
            for k, v in {"reserve": 8, "seed": 3, **kw}.items():
                gin.bind_parameter(f"Loader.{k}", v)
        try:
            lb = LoaderBatches.from_gin(source(bad=0.2), LAYOUT, 8, grow)
            out = [next(lb)[0] for _ in range(3)]
            lb.close()
            return out
        finally:
            gin.clear_config()

    ref, got = batches(), batches(producers=1)
    for a, b in zip(ref, got):
        for k, v in a.arrays().items():
            np.testing.assert_array_equal(v, b.arrays()[k], err_msg=k)


@pytest.mark.slow
def test_backpressure_and_errors():
    import math
    import operator
    import time

    from mmjax.data.producer_pool import ProducerPool

    pool = ProducerPool(operator.neg, 0, 100, local=2, prefetch=2)
    try:
        assert [next(pool) for _ in range(3)] == [0, -1, -2]
        time.sleep(1.0)  # a slow trainer: nothing beyond the window is asked for or held
        held = set(pool.results) | {s for p in pool.producers for s in p.outstanding}
        assert held and max(held) < pool.next + pool.window == 3 + 4
        assert [next(pool) for _ in range(5)] == [-3, -4, -5, -6, -7]
    finally:
        pool.close()
    pool = ProducerPool(math.log, 0, 3, local=1)  # log(0): the producer's error, raised here
    try:
        with pytest.raises(ValueError, match="math domain error"):
            next(pool)
    finally:
        pool.close()
