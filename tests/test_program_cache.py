"""train/program_cache.py: a compiled step stored by what it is made from and loaded
untraced; another argument tree, another description or other gin bindings miss; the
bindings leave out `train.steps` (the step does not depend on it)."""
import os
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.train import program_cache

DEV = jax.devices()[:1]  # where jit puts the toy program


def _f(state, x, rate):
    return {"w": state["w"] * rate + x.sum()}, (x * state["w"]).sum()


def _compiled(n=3):
    """A fresh XLA compile (JAX's persistent cache off, and a program no cache can hold:
    a constant unique to this call, which adds an exact 0): what `store` is given."""
    args = ({"w": jnp.ones(n)}, jnp.arange(n, dtype=jnp.float32), np.float32(2))
    salt = float(time.time_ns() % 1_000_003 + os.getpid() % 1_000_000)  # < 2^24: exact

    def toy(state, x, rate):
        new, out = _f(state, x, rate)
        return new, out + ((x[0] * 0 + salt) - salt)
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        with program_cache.compiling() as hits:
            compiled = jax.jit(toy, donate_argnums=(0,)).lower(*args).compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
    assert not hits
    return args, compiled


def test_compiling_sees_a_hit_of_jaxs_cache(tmp_path):
    """The program JAX's cache answers is told apart (it is not stored)."""
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    try:
        g = lambda x: x * 5 - 1  # noqa: E731
        seen = []
        for _ in range(2):
            jax.clear_caches()
            with program_cache.compiling() as hits:
                jax.jit(g).lower(jnp.ones(4)).compile()
            seen.append(bool(hits))
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
    assert seen == [False, True]


def test_stored_program_loads_untraced_and_runs_the_same(tmp_path):
    args, compiled = _compiled()
    key = program_cache.program_key("toy", "n=3")
    tree = jax.tree.structure((args, {}))
    assert program_cache.load(str(tmp_path), key, tree, DEV) is None  # nothing stored yet
    program_cache.store(str(tmp_path), key, compiled)
    loaded = program_cache.load(str(tmp_path), key, tree, DEV)
    want = compiled({"w": jnp.ones(3)}, *args[1:])
    got = loaded({"w": jnp.ones(3)}, *args[1:])
    assert float(got[1]) == float(want[1])
    np.testing.assert_array_equal(got[0]["w"], want[0]["w"])
    # another argument tree under the same key is not used
    other = jax.tree.structure((({"v": 1.0}, 1.0, 1.0), {}))
    assert program_cache.load(str(tmp_path), key, other, DEV) is None
    assert program_cache.load(None, key, tree, DEV) is None  # cache off


def test_key_names_the_description_and_the_bindings_but_not_train_steps():
    from mmjax.cli import register_configurables

    register_configurables()
    base = program_cache.program_key("toy", "n=3")
    assert program_cache.program_key("toy", "n=3") == base
    assert program_cache.program_key("toy", "n=4") != base
    with gin.unlock_config():
        gin.parse_config(["train.steps = 7"])
        try:
            assert program_cache.program_key("toy", "n=3") == base
            gin.parse_config(["train.global_batch = 3"])
            assert program_cache.program_key("toy", "n=3") != base
        finally:
            gin.clear_config()


@pytest.mark.parametrize("blob", [b"", b"not a pickle"])
def test_a_broken_entry_is_a_miss(tmp_path, blob):
    key = program_cache.program_key("toy", "broken")
    (tmp_path / f"mmjax-program-{key}.pkl").write_bytes(blob)
    args, _ = _compiled()
    assert program_cache.load(str(tmp_path), key, jax.tree.structure((args, {})), DEV) is None


def test_a_program_jaxs_cache_answered_is_stored_from_the_earlier_entry(tmp_path):
    """After a source change every key is new and JAX's cache answers the step: its
    executable does not serialize whole on XLA:CPU (`Function ... not found` when run),
    so the entry is made from the earlier entry of the same compiled program, and the
    next run loads it untraced. Without an earlier entry nothing is stored."""
    cache = str(tmp_path)
    x = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
    salt = float(time.time_ns() % 1_000_003)

    def g(x):
        return jnp.sin(x) @ x.T + salt

    def compile_once():
        jax.clear_caches()
        with program_cache.compiling() as hits:
            return jax.jit(g).lower(x).compile(), bool(hits)
    tree = jax.tree.structure(((x,), {}))
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cache)
    try:
        first, hit = compile_once()
        assert not hit
        program_cache.store(cache, "a" * 40, first)  # the run before the source change
        again, hit = compile_once()
        assert hit
        program_cache.store(cache, "b" * 40, again, from_jax_cache=True)
        loaded = program_cache.load(cache, "b" * 40, tree, DEV)
        # no earlier entry of this program: a hit of JAX's cache stores nothing
        os.remove(tmp_path / f"mmjax-program-{'a' * 40}.pkl")
        os.remove(tmp_path / f"mmjax-program-{'b' * 40}.pkl")
        program_cache.store(cache, "c" * 40, compile_once()[0], from_jax_cache=True)
    finally:
        jax.config.update("jax_compilation_cache_dir", old)
    assert loaded is not None
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(first(x)))
    assert not (tmp_path / f"mmjax-program-{'c' * 40}.pkl").exists()


def test_an_entry_stored_without_its_digest_is_named_when_loaded(tmp_path):
    """Entries written before they carried their program's digest: loading one names it,
    so a later hit of JAX's cache for the same program is stored from it."""
    import pickle

    from jax.experimental.serialize_executable import serialize

    cache = str(tmp_path)
    args, compiled = _compiled()
    tree = jax.tree.structure((args, {}))
    with open(tmp_path / f"mmjax-program-{'d' * 40}.pkl", "wb") as f:
        pickle.dump(serialize(compiled), f)  # the old three-part entry
    assert not [p for p in os.listdir(cache) if "by-hlo" in p]
    assert program_cache.load(cache, "d" * 40, tree, DEV) is not None
    named = [p for p in os.listdir(cache) if "by-hlo" in p]
    assert len(named) == 1
    assert (tmp_path / named[0]).read_text() == "d" * 40
