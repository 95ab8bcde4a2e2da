"""Soft-caps exactly where transformers applies them (issue 42): Gemma 3's attention has
none whatever `attn_logit_softcapping` says (transformers' Gemma3Attention never passes it);
LLaVA's lm_head has no final soft-cap over a Gemma 2 text model (LlavaForConditionalGeneration
is a plain Linear head). Both against transformers' own logits (tests/data/families)."""
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import hf_reference as ref  # noqa: E402
import llava_tiny  # noqa: E402
from test_decoder_families import DATA, assert_close, family_weights  # noqa: E402
from mmjax.models import hf  # noqa: E402


def family(name):
    z = np.load(DATA / f"{name}.npz")
    names, shapes = [str(n) for n in z["names"]], json.loads(str(z["shapes"]))
    return z, family_weights(names, shapes, int(z["seed"]))


def test_gemma3_attention_softcap_field_is_not_applied(tmp_path):
    z, t = family("gemma3")
    for layout in ("v4", "v5"):
        c = json.loads(str(z[f"config_{layout}"]))
        c["attn_logit_softcapping"] = 0.5  # would change every score if applied
        d = tmp_path / layout
        d.mkdir()
        (d / "config.json").write_text(json.dumps(c))
        save_file(t, str(d / "model.safetensors"))
        module, cfg = hf.load(d)
        assert cfg.attn_softcap is None
        assert_close(hf.hf_forward(module, input_ids=z["tokens"][None])["logits"][0],
                     z["logits"].astype(np.float64))


def test_llava_over_gemma2_has_no_final_softcap(tmp_path):
    """The text before the image attends to no image token, so LLaVA's logits there are
    Gemma 2's before its final soft-cap: capped again they are transformers' Gemma2 logits."""
    z, t = family("gemma2")
    text = json.loads(str(z["config_v5"]))
    cap = text["final_logit_softcapping"]
    image = 27  # not among the prompt's tokens
    conf = dict(llava_tiny.CONFIG, text_config=text, image_token_index=image,
                tie_word_embeddings=True)
    tower = {k: v for k, v in llava_tiny.tensors("tf5").items() if k.startswith("vision_tower.")}
    rng = np.random.default_rng(5)
    d_v, d = llava_tiny.VISION["hidden_size"], text["hidden_size"]
    proj = {"multi_modal_projector.linear_1.weight": ref.rand(rng, d, d_v),
            "multi_modal_projector.linear_1.bias": ref.rand(rng, d),
            "multi_modal_projector.linear_2.weight": ref.rand(rng, d, d),
            "multi_modal_projector.linear_2.bias": ref.rand(rng, d)}
    llm = {"language_model.model." + k[len("model."):]: v for k, v in t.items()}
    src = ref.write_checkpoint(tmp_path / "llava", conf, {**tower, **proj, **llm})
    model, cfg = hf.load(src)
    assert cfg.llm.final_softcap is None and cfg.llm.attn_softcap == text["attn_logit_softcapping"]
    n = len(z["tokens"])
    ids = np.concatenate([z["tokens"], np.full(16, image)])[None]
    pixels = np.random.default_rng(6).normal(size=(1, 3, 16, 16)).astype(np.float32)
    got = np.asarray(hf.hf_forward(model, input_ids=ids, pixel_values=pixels)["logits"])[0, :n]
    assert np.abs(got).max() > cap  # not capped
    assert_close(cap * np.tanh(got.astype(np.float64) / cap), z["logits"].astype(np.float64))
