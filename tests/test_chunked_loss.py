"""The fused chunked LM head + cross-entropy (models/chunked_loss.py) against the plain path.

Value and gradients (hidden states and head weight) equal `lm_loss_sum(logits)` in float32
(tests/helpers.py's rule: as close to the float64 plain path as float32's plain path is)
with and without Gemma's soft-cap, with a chunk that does not divide the token
count and a partial loss mask; in bfloat16 they stay within bf16 rounding of float32; the
head sharded over the vocabulary (TP's rule) gives the same numbers; the compiled gradient
holds no [tokens, vocab] float32 logits (temporary memory well under the plain path's); an
LLM with `loss_chunk` set trains to the same loss and gradients as without.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mmjax.errors import UserError
from mmjax.models.chunked_loss import chunked_lm_loss_sum
from mmjax.models.config import LLMConfig
from mmjax.models.llm import LLM, lm_loss_sum
from mmjax.models.attention import f32_einsum
from mmjax.models.attention_mask import cap_logits
from float64_reference import in_float64
from helpers import Exact, assert_same_grads

pytestmark = pytest.mark.parity  # judged by the float64 rule; CI reruns it under a second XLA config


def _data(n=2, s=37, d=32, v=300, seed=0):
    r = np.random.default_rng(seed)
    h = jnp.asarray(r.normal(size=(n, s, d)), jnp.float32)
    w = jnp.asarray(r.normal(size=(d, v)) / np.sqrt(d), jnp.float32)
    t = jnp.asarray(r.integers(0, v, size=(n, s)), jnp.int32)
    m = jnp.asarray(r.random((n, s)) < 0.7)
    return h, w, t, m


def _plain(h, w, t, m, cap):
    return lm_loss_sum(cap_logits(f32_einsum("...d,dv->...v", h, w.astype(h.dtype)), cap), t, m)


def _exact(fn, *args, length: int) -> Exact:
    """`fn(*args)` in float32 and in float64; `length`: its longest sum."""
    return Exact(jax.jit(fn)(*args), in_float64(fn)(*args), length)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_value_and_grads_equal_plain_f32(cap):
    h, w, t, m = _data()
    plain = jax.jit(jax.value_and_grad(_plain, argnums=(0, 1)), static_argnums=4)
    fused = jax.jit(jax.value_and_grad(chunked_lm_loss_sum, argnums=(0, 1)),
                    static_argnums=(4, 5))
    (lp, (ghp, gwp)) = plain(h, w, t, m, cap)
    (lf, (ghf, gwf)) = fused(h, w, t, m, cap, 16)  # 74 tokens: 5 chunks, the last padded
    ref = _exact(lambda h, w: jax.value_and_grad(_plain, argnums=(0, 1))(h, w, t, m, cap),
                 h, w, length=max(t.size, w.shape[1]))  # over tokens (dW), vocabulary (dh)
    assert_same_grads((lf, (ghf, gwf)), ref)
    assert float(jnp.abs(ghp[~m]).max()) == 0.0  # unscored positions get no gradient
    assert float(jnp.abs(ghf[~m]).max()) == 0.0
    # the primal alone (evaluation) is the same sum
    assert_same_grads(jax.jit(chunked_lm_loss_sum, static_argnums=(4, 5))(h, w, t, m, cap, 16),
                      Exact(ref.f32[0], ref.f64[0], ref.length))


def test_bf16_within_rounding_of_f32():
    h, w, t, m = _data(s=64, d=64, v=512, seed=1)
    ref = jax.jit(jax.grad(_plain, argnums=(0, 1)), static_argnums=4)(h, w, t, m, None)
    lf, (gh, gw) = jax.jit(jax.value_and_grad(chunked_lm_loss_sum, argnums=(0, 1)),
                           static_argnums=(4, 5))(h.astype(jnp.bfloat16), w, t, m, None, 32)
    np.testing.assert_allclose(lf, jax.jit(_plain, static_argnums=4)(h, w, t, m, None),
                               rtol=2e-2)
    assert gh.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
    for got, want in ((gh, ref[0]), (gw, ref[1])):
        err = np.abs(np.asarray(got, np.float32) - np.asarray(want))
        assert err.max() <= 0.05 * np.abs(np.asarray(want)).max()


def test_vocab_sharded_head_gives_the_same_numbers():
    h, w, t, m = _data(v=512)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
    f = jax.jit(jax.value_and_grad(chunked_lm_loss_sum, argnums=(0, 1)), static_argnums=(4, 5))
    l1, g1 = f(h, w, t, m, None, 24)
    l2, g2 = f(h, ws, t, m, None, 24)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_no_full_logits_in_memory():
    """1024 tokens x 8192 vocabulary: the plain gradient holds 32 MB float32 logits (and
    their gradient); chunks of 128 tokens hold 4 MB at a time."""
    h, w, t, m = _data(n=4, s=256, d=64, v=8192, seed=2)
    temp = {}
    for name, fn in (("plain", lambda h, w: _plain(h, w, t, m, None)),
                     ("fused", lambda h, w: chunked_lm_loss_sum(h, w, t, m, None, 128))):
        c = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(h, w).compile()
        temp[name] = c.memory_analysis().temp_size_in_bytes
    logits_bytes = 1024 * 8192 * 4
    assert temp["plain"] >= logits_bytes
    assert temp["fused"] < 0.4 * logits_bytes, temp


def test_llm_with_loss_chunk_equals_plain():
    cfg = LLMConfig(vocab_size=384, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                    ffn_size=64, tie_embeddings=True)
    import dataclasses
    r = np.random.default_rng(3)
    tokens = jnp.asarray(r.integers(0, 384, size=(2, 24)), jnp.int32)
    mask = jnp.asarray(r.random((2, 24)) < 0.8)

    def loss_and_grads(c):
        model = LLM(c, jax.random.key(0))
        graph, params = nnx.split(model)

        def loss(p):
            mod = nnx.merge(graph, p)
            h = mod.final_hidden(mod.embed_tokens(tokens))
            return mod.loss_sum(h, jnp.roll(tokens, -1, axis=1), mask)
        return jax.value_and_grad(loss), params

    fn, params = loss_and_grads(cfg)
    ref = _exact(fn, params, length=cfg.vocab_size)  # the longest sum: the vocabulary's
    fn1, params1 = loss_and_grads(dataclasses.replace(cfg, loss_chunk=20))
    assert_same_grads(jax.jit(fn1)(params1), ref)
    with pytest.raises(UserError, match="loss_chunk"):
        dataclasses.replace(cfg, loss_chunk=-1)


def test_memory_model_keeps_no_logits_with_loss_chunk():
    """planner/memory.py: the last LLM stage keeps n x vocab float32 logits, unless fused."""
    import dataclasses

    from mmjax.planner import memory

    c = LLMConfig(vocab_size=1000, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  ffn_size=64)
    plain = memory.llm_acts(c, 100, 100 * 100, 1, 2, "pallas")
    fused = memory.llm_acts(dataclasses.replace(c, loss_chunk=64), 100, 100 * 100, 1, 2, "pallas")
    assert plain.none - fused.none == pytest.approx(100 * 1000 * memory.F32)
    assert plain.dots - fused.dots == pytest.approx(100 * 1000 * memory.F32)
