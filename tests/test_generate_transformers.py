"""scripts/generate.py's decoding (models/decode.py: prefill, then one KV-cached step per
token) and `hf.generate` against transformers' greedy `generate` on the whole-model fixtures
(LLaVA, Qwen2-VL, Qwen2.5-VL, each decoder family under LLaVA): the same 16 tokens and every
step's logits to float32 rounding; `hf.generate` also on left-padded batches of two (the
whole models and each family as a text-only LLM) with the checkpoints' own eos / pad ids, and
with a generation_config.json's repetition penalty.
Reference: tests/data/generate/reference.npz and hf_generate.npz from
tests/fixtures/make_generate_reference.py (transformers 5.24, run once; no torch here),
prompts from tests/generate_prompts.py."""
import json
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
HF = np.load(os.path.join(gp.DATA, "generate", "hf_generate.npz"))
# left-padded batches of two (about a second each); the "_penalty" ones with a
# generation_config.json's repetition penalty; the rest of the families under -m slow
BATCHES = ("llava_batch", "qwen2_vl_batch", "text_gemma3", "text_phi3",
           "qwen2_vl_batch_penalty", "text_llama_linear_penalty")
SLOW_BATCHES = ("qwen2_5_vl_batch",) + tuple(
    f"text_{f}" for f in gp.FAMILIES if f"text_{f}" not in BATCHES)


@pytest.mark.parametrize("case", gp.CASES)
def test_greedy_generation_is_transformers(tmp_path, case):
    model, cfg = hf.load(gp.checkpoint(case, tmp_path))
    batch, p, inputs = gp.prompt(case, cfg)
    for k, v in inputs.items():  # the prompt transformers was given
        np.testing.assert_array_equal(v, PROMPTS[f"{case}/{k}"])
    want_tokens, want = REF[f"{case}/tokens"], REF[f"{case}/logits"]
    assert generate(model, batch, p, gp.NEW) == want_tokens.tolist()
    # hf.generate with transformers' defaults (the checkpoint's eos: llava_phi3 stops early)
    got_hf = hf.generate(model, max_new_tokens=gp.NEW, **inputs)
    np.testing.assert_array_equal(got_hf, HF[f"{case}/default"][None])
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


def batch_checkpoint(case: str, root):
    if case.endswith("_penalty"):
        from llava_families import with_penalty
        base = batch_checkpoint(case[: -len("_penalty")], root)
        return with_penalty(base, root / case)
    if case == "llava_batch":
        import llava_tiny
        return llava_tiny.write(root / case, "tf5")
    if case.endswith("vl_batch"):
        return os.path.join(gp.DATA, "qwen2_vl", case[: -len("_batch")] + "_tf5")
    from llava_families import text_source
    return text_source(root / case, case[len("text_"):])[0]


def check_batch(case: str, root):
    """hf.generate on a reference batch: transformers' tokens (eos rows padded, early end)."""
    model, _ = hf.load(batch_checkpoint(case, root))
    inputs = {k.split("/", 1)[1]: HF[k] for k in HF.files
              if k.startswith(case + "/") and not k.endswith("/tokens")}
    want = HF[f"{case}/tokens"]
    assert inputs["attention_mask"].min() == 0  # a padded batch
    got = hf.generate(model, max_new_tokens=gp.NEW, **inputs)
    np.testing.assert_array_equal(got, want)
    if case.startswith("text_"):  # no attention_mask: inferred from the pad id, as transformers
        del inputs["attention_mask"]
        np.testing.assert_array_equal(hf.generate(model, max_new_tokens=gp.NEW, **inputs), want)


@pytest.mark.parametrize("case", BATCHES)
def test_hf_generate_left_padded_batches_are_transformers(tmp_path, case):
    check_batch(case, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_BATCHES)
def test_hf_generate_more_batches_are_transformers(tmp_path, case):
    check_batch(case, tmp_path)


def test_hf_generate_covers_every_reference():
    cases = {k.split("/")[0] for k in HF.files if "/" in k}
    assert cases == set(gp.CASES) | set(BATCHES) | set(SLOW_BATCHES)
    # the references exercise stopping: a row finished early, padded with the pad id (0)
    assert HF["llava_phi3/default"].tolist()[-1] == 2 and len(HF["llava_phi3/default"]) < gp.NEW
    assert (HF["text_phi3/tokens"][1] == [2] + [0] * (gp.NEW - 1)).all()


def test_hf_generate_refuses_what_it_would_get_wrong(tmp_path):
    from llava_families import text_source
    d = text_source(tmp_path / "qwen3", "qwen3")[0]
    model, _ = hf.load(d)
    ids = np.array([[1, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"inputs \['pixel_values'\] do not apply"):
        hf.generate(model, max_new_tokens=2, input_ids=ids, pixel_values=np.zeros(3))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2,
                                                          "no_repeat_ngram_size": 2}))
    with pytest.raises(ValueError, match="no_repeat_ngram_size"):
        hf.generate(model, max_new_tokens=2, input_ids=ids)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 9],
                                                          "pad_token_id": 3}))
    got = hf.generate(model, max_new_tokens=4, input_ids=ids, eos_token_id=[])
    assert got.shape == (1, 4)


def test_hf_generate_llava_text_only_prompt_is_its_text_model(tmp_path):
    """A LLaVA prompt without an image runs its text model alone, as transformers' LLaVA:
    the llama_linear LLaVA gives the tokens transformers gave the same text checkpoint."""
    from llava_families import llava_source
    model, _ = hf.load(llava_source(tmp_path / "llava", "llama_linear", "clip")[0])
    x = {k.split("/", 1)[1]: HF[k] for k in HF.files
         if k.startswith("text_llama_linear/") and not k.endswith("/tokens")}
    np.testing.assert_array_equal(hf.generate(model, max_new_tokens=gp.NEW, **x),
                                  HF["text_llama_linear/tokens"])
    with pytest.raises(ValueError, match="image tokens .* but no pixel_values"):
        hf.generate(model, max_new_tokens=2, input_ids=np.array([[1, 27, 5]]))
