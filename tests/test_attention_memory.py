"""No [S, S] buffer: the chunked attention's compiled train step stays O(S * block) in memory.

Compile only (nothing runs): XLA's memory analysis of a whole tiny-LLM train step (forward,
backward through every layer, an SGD update) at 16k tokens, chunked vs dense attention.
"""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from mmjax.models.attention import causal_meta
from mmjax.models.llm import LLM, lm_loss_sum, meta_attend
from mmjax.models.tiny import TINY_LLM


def _temp_bytes(seq_len: int, impl: str) -> int:
    graphdef, params = nnx.split(LLM(TINY_LLM, jax.random.key(0)))

    def step(params, tokens, segments):
        def loss(p):
            model = nnx.merge(graphdef, p)
            pos = jnp.broadcast_to(jnp.arange(seq_len), tokens.shape)
            h = model.run_layers(model.embed_tokens(tokens), pos,
                                 meta_attend(causal_meta(segments), impl))
            return lm_loss_sum(model.logits(model.final_hidden(h)), tokens, segments != 0)
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)

    ids = jax.ShapeDtypeStruct((1, seq_len), jnp.int32)
    compiled = jax.jit(step).lower(params, ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_chunked_train_step_temp_memory_far_below_dense_and_64k_compiles():
    dense, chunked = _temp_bytes(16384, "dense"), _temp_bytes(16384, "chunked")
    # dense holds [B, H, S, S] float32 logits/probabilities: 16k^2 * 4 heads * 4 B = 4 GiB each
    assert dense > 4 * 16384 ** 2 * 4
    assert chunked * 20 < dense, (chunked, dense)
    long = _temp_bytes(65536, "chunked")
    assert long < 16 * chunked  # linear in S (4x tokens), nothing quadratic
