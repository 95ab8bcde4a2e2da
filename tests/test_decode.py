"""KV-cache decoding equals recomputing the whole sequence each step; top-p sampling keeps
exactly the nucleus."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.data.layout import AssemblyLayout
from mmjax.data.assemble import assemble
from mmjax.data.sample import Sample, Segment
from mmjax.models.config import with_overrides
from mmjax.models.decode import generate, sample_token
from mmjax.models.llm import mask_attend
from mmjax.models.mllm import MultimodalModel, encode, llm_allowed, llm_embed
from mmjax.models.tiny import tiny
from mmjax.train.inputs import model_inputs


# A Gemma-3-style LLM: one sliding-window layer with its own RoPE base, one global layer,
# soft-capped attention and final logits (the cache path applies the window by cache slot).
LOCAL_GLOBAL = {"llm.sliding_window": 4, "llm.sliding_layers": (True, False),
                "llm.rope_local_theta": 100.0, "llm.attn_softcap": 5.0,
                "llm.final_softcap": 10.0, "llm.qk_norm": True, "llm.sandwich_norms": True}


@pytest.fixture(scope="module", params=["plain", "local_global"])
def prompt(request):
    extra = LOCAL_GLOBAL if request.param == "local_global" else {}
    cfg = with_overrides(tiny(), {"generator": None, "llm.num_layers": 2,
                                  "encoders.vision.encoder.num_layers": 1, **extra})
    lay = AssemblyLayout.from_config(cfg, 64, vision_caps=(64,))
    rng = np.random.default_rng(0)
    s = Sample(0, (Segment("text", rng.integers(16, 500, 5).astype(np.int32)),
                   Segment("image", rng.random((8, 12, 3), dtype=np.float32)),
                   Segment("text", rng.integers(16, 500, 4).astype(np.int32))))
    batch = model_inputs(assemble([s], lay))
    p = int((batch["doc"][0] == 1).sum()) - 1  # without the document's eos
    return cfg, MultimodalModel(cfg, jax.random.key(1)), batch, p


def _full_logits(model, batch, p, new):
    """Logits at every position of prompt + `new` tokens in one pass, no cache (teacher
    forcing): the training mask on the prompt, causal over the new tokens."""
    cfg = model.cfg
    enc = {e.name: encode(e, model.encoders[e.name], model.projectors[e.name],
                          batch["encoders"][e.name]) for e in cfg.encoders}
    x = llm_embed(cfg, model.llm, batch, enc)[:, :p]
    x = jnp.concatenate([x, model.llm.embed_tokens(jnp.asarray([new], jnp.int32))], axis=1)
    n = p + len(new)
    allowed = jnp.zeros((1, n, n), bool).at[:, :p, :p].set(llm_allowed(batch)[:, :p, :p])
    allowed = allowed.at[:, p:, :].set(jnp.arange(n)[None, :] <= jnp.arange(p, n)[:, None])
    h = model.llm.run_layers(x, jnp.arange(n)[None], mask_attend(allowed))
    return model.llm.logits(model.llm.final_hidden(h))[0]


@pytest.mark.slow  # model init + two compiles: ~30 s CPU
def test_kv_cache_greedy_matches_recompute(prompt):
    from flax import nnx
    from mmjax.models.decode import decode_step, prefill

    cfg, model, batch, p = prompt
    out = generate(model, batch, p, max_new_tokens=6)
    assert len(out) == 6
    full = _full_logits(model, batch, p, out)
    # greedy: each generated token is the argmax of the uncached logits before it
    assert [int(t) for t in jnp.argmax(full[p - 1:p + 5], axis=-1)] == out
    g, st = nnx.split(model)
    logits, cache = prefill(g, st, batch, p, p + 6)
    np.testing.assert_allclose(logits[0], full[p - 1], rtol=1e-5, atol=1e-5)
    for t in range(2):
        logits, cache = decode_step(g, st, jnp.asarray([out[t]], jnp.int32), jnp.int32(p + t),
                                    cache)
        np.testing.assert_allclose(logits[0], full[p + t], rtol=1e-5, atol=1e-5)
    # stop ids end generation before the stop token
    assert generate(model, batch, p, 6, stop_ids=(out[2],)) == out[:2]


def test_top_p_keeps_the_nucleus():
    logits = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))
    # nucleus for p = 0.75: 0.4 + 0.3 = 0.7 < 0.75, so 0.15 joins: {1, 3, 4}
    many = jnp.tile(logits, (400, 1))  # 400 independent draws (one row each)
    assert set(np.asarray(sample_token(many, jax.random.key(0), 1.0, 0.75)).tolist()) == {1, 3, 4}
    assert set(np.asarray(sample_token(many, jax.random.key(1), 1.0, 0.01)).tolist()) == {1}
    assert int(sample_token(logits, jax.random.key(0), 0.0)[0]) == 1  # greedy
    assert int(sample_token(logits, jax.random.key(0), 0.0, vocab=1)[0]) == 0  # padding ids out
