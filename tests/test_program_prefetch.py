"""train/program_prefetch.py and the stored init (train/single_program.py): a run
remembers its step's program key, the next run of the same kind loads that entry in a
thread from its start and uses it only under an equal key; the single program's init is
stored like the step and loaded untraced (jax.monitoring's trace events)."""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mmjax.models.config import with_overrides
from mmjax.models.mllm import trainable_filter
from mmjax.models.tiny import tiny
from mmjax.parallel.sharded_init import init_states
from mmjax.train import program_cache
from mmjax.train.program_prefetch import Prefetch
from mmjax.train.state import WHOLE_MODEL
from mmjax.models.mllm import MultimodalModel

DEV = jax.devices()[:1]
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"


def _toy(n=3):
    """A fresh XLA compile, as the program cache stores it (an executable JAX's cache
    answered does not serialize whole on XLA:CPU): the cache off, and a constant unique
    to this call (an exact 0 added) so no cache can hold it."""
    args = ({"w": jnp.ones(n)}, jnp.arange(n, dtype=jnp.float32))
    salt = float(time.time_ns() % 1_000_003 + os.getpid() % 1_000_000)  # < 2^24: exact
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        compiled = jax.jit(lambda s, x: {"w": s["w"] * 2 + ((x + salt) - salt)}).lower(
            *args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    return args, compiled


def _cache_dir(path):
    """JAX's cache (and so the program cache) in `path` for a block; restored after."""
    class _Use:
        def __enter__(self):
            self.old = jax.config.jax_compilation_cache_dir
            jax.config.update("jax_compilation_cache_dir", str(path))

        def __exit__(self, *exc):
            jax.config.update("jax_compilation_cache_dir", self.old)
    return _Use()


def test_the_last_runs_key_loads_in_a_thread_and_serves_only_that_key(tmp_path):
    cache = str(tmp_path)
    args, compiled = _toy()
    tree = jax.tree.structure((args, {}))
    with _cache_dir(tmp_path):  # `program_cache.store` reads no config; JAX may write here
        key = program_cache.program_key("toy", "n=3")
        program_cache.store(cache, key, compiled)
    first = Prefetch.remembered(cache, "toy run", DEV)
    assert first.key is None and first.take(key) is None  # no run before
    first.remember(key)
    index = [p for p in os.listdir(cache) if p.startswith("mmjax-program-last-")]
    assert len(index) == 1 and (tmp_path / index[0]).read_text() == key

    again = Prefetch.remembered(cache, "toy run", DEV)
    assert again.key == key
    assert again.take("another key") is None  # another program: the step's own load
    loaded = program_cache.load(cache, key, tree, DEV, again.take(key))
    want = compiled({"w": jnp.ones(3)}, args[1])
    np.testing.assert_array_equal(loaded({"w": jnp.ones(3)}, args[1])["w"], want["w"])
    # an entry under another argument tree is refused, prefetched or not
    other = jax.tree.structure((({"v": 1.0}, 1.0), {}))
    assert program_cache.load(cache, key, other, DEV, again.take(key)) is None
    # another kind of run has its own index
    assert Prefetch.remembered(cache, "another run", DEV).key is None


def test_a_remembered_key_whose_entry_is_gone_is_a_miss(tmp_path):
    cache = str(tmp_path)
    Prefetch.remembered(cache, "toy run", DEV).remember("f" * 40)
    p = Prefetch.remembered(cache, "toy run", DEV)
    assert p.key == "f" * 40 and p.take("f" * 40) is None


def test_cache_off_prefetches_and_writes_nothing(tmp_path):
    p = Prefetch.remembered(None, "toy run", DEV)
    p.remember("a" * 40)
    assert p.take("a" * 40) is None
    assert Prefetch(None, "a" * 40, DEV).take("a" * 40) is None
    assert os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def small_cfg():
    """The tiny MLLM at one layer per unit: an init that compiles in about a second."""
    return with_overrides(tiny(), {"llm.num_layers": 1, "encoders.vision.encoder.num_layers": 1,
                                   "generator.num_layers": 1})


def test_the_init_is_stored_then_loaded_untraced_with_the_same_values(tmp_path, small_cfg):
    from mmjax.train.single_program import OneDevice

    cfg, key = small_cfg, jax.random.key(7)
    filters = (trainable_filter(cfg), ...)
    traced = []

    def listener(event, duration, fun_name=None, **_):
        if event == TRACE_EVENT:
            traced.append(fun_name)

    with _cache_dir(tmp_path):
        OneDevice().init(cfg, key, filters, optax.sgd(0.1), (None, None))
        stored = [p for p in os.listdir(tmp_path) if p.startswith("mmjax-program-")
                  and p.endswith(".pkl")]
        assert len(stored) == 1  # the init's entry
        second = OneDevice()
        second.prefetch_init(cfg, key, filters)  # a runner does this before its data scan
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            state, frozen = second.init(cfg, key, filters, optax.sgd(0.1), (None, None))
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    assert "_init_states" not in traced, traced  # loaded, not traced
    want_trainable, want_frozen = init_states(MultimodalModel, (cfg,), key, filters)
    got = jax.tree.leaves((state.stages[WHOLE_MODEL].master, frozen))
    want = jax.tree.leaves((want_trainable, want_frozen))
    assert len(got) == len(want) > 0
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_second_runner_takes_the_step_and_init_its_first_run_stored(tmp_path, small_cfg):
    """Two single-program runners of one kind on one cache, as two runs: the second's
    first step traces neither the step nor the init (both loaded in threads from its
    construction) and computes the first's loss."""
    from mmjax.train.data_config import data_layout
    from mmjax.train.single_program import OneDevice
    from mmjax.train.whole_model import WholeModelRunner

    traced = []

    def listener(event, duration, fun_name=None, **_):
        if event == TRACE_EVENT:
            traced.append(fun_name)

    def first_loss() -> tuple[float, str | None]:
        """(the first step's loss, the step key the runner prefetched)."""
        runner = WholeModelRunner(small_cfg, data_layout(small_cfg), 4, 1e-3, jnp.float32, 0,
                                  OneDevice())
        try:
            prefetched = runner._prefetch.key  # known at construction: loading meanwhile
            loss = runner.step().loss
            if prefetched is not None:  # the step's own key was the remembered one
                assert runner._prefetch.take(prefetched) is not None
            return loss, prefetched
        finally:
            runner.close()

    with _cache_dir(tmp_path):
        loss, prefetched = first_loss()
        assert prefetched is None  # nothing remembered yet
        assert any(p.startswith("mmjax-program-last-") for p in os.listdir(tmp_path))
        jax.monitoring.register_event_duration_secs_listener(listener)
        try:
            again, prefetched = first_loss()
        finally:
            jax.monitoring.unregister_event_duration_listener(listener)
    assert prefetched is not None
    assert not {"train_step", "_init_states"} & set(traced), traced
    assert again == loss
