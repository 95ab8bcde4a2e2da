"""scripts/generate.py's decoding (models/decode.py: prefill, then one KV-cached step per
token) against transformers' greedy `generate` on the whole-model fixtures (LLaVA,
Qwen2-VL, Qwen2.5-VL): the same 16 tokens and every step's logits to float32 rounding.
Reference: tests/data/generate/reference.npz from tests/fixtures/make_generate_reference.py
(transformers 5.24, run once; no torch here), prompts from tests/generate_prompts.py."""
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import generate_prompts as gp
from mmjax.models import hf
from mmjax.models.decode import decode_step, generate, next_rope_position, prefill

REF = np.load(os.path.join(gp.DATA, "generate", "reference.npz"))
PROMPTS = np.load(os.path.join(gp.DATA, "generate", "prompts.npz"))


@pytest.mark.parametrize("case", gp.CASES)
def test_greedy_generation_is_transformers(tmp_path, case):
    model, cfg = hf.load(gp.checkpoint(case, tmp_path))
    batch, p, inputs = gp.prompt(case, cfg)
    for k, v in inputs.items():  # the prompt transformers was given
        np.testing.assert_array_equal(v, PROMPTS[f"{case}/{k}"])
    want_tokens, want = REF[f"{case}/tokens"], REF[f"{case}/logits"]
    assert generate(model, batch, p, gp.NEW) == want_tokens.tolist()
    graphdef, state = nnx.split(model)
    logits, cache = prefill(graphdef, state, batch, p, p + gp.NEW)
    rope = next_rope_position(jnp.asarray(batch["positions"]), p)
    got = [np.asarray(logits[0])]
    for t in range(gp.NEW - 1):
        logits, cache = decode_step(graphdef, state, jnp.asarray([want_tokens[t]], jnp.int32),
                                    jnp.int32(p + t), cache, rope + t)
        got.append(np.asarray(logits[0]))
    got = np.stack(got)[:, : want.shape[1]]
    err = np.abs(got - want).max() / np.abs(want).max()
    print(f"{case}: max relative logit error {err:.2e}")
    assert err < 1e-5
