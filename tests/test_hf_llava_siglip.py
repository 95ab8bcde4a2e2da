"""LLaVA over a SigLIP tower (issue 42): transformers' "full" select strategy (every patch
projected; what SigLIP LLaVAs use) against a float64 NumPy LLaVA (tests/hf_reference.py's
SigLIP tower and Qwen2 decoder, the projector in between); the pairings transformers reads
otherwise than mmjax projects ("default" over SigLIP drops the first patch, "full" over CLIP
keeps the class token) refused in one line naming the field; save writes the strategy."""
import json
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import hf_reference as ref  # noqa: E402
import llava_tiny  # noqa: E402
from llava_families import SIGLIP  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.mllm import MultimodalModel  # noqa: E402

CONFIG = dict(llava_tiny.CONFIG, vision_config=SIGLIP, vision_feature_select_strategy="full")


def checkpoint(d):
    t = {k: v for k, v in llava_tiny.tensors("tf5").items() if not k.startswith("vision_tower.")}
    t.update(ref.tower_tensors("siglip", SIGLIP, seed=21, prefix="vision_tower.", std=0.1))
    return ref.write_checkpoint(d, CONFIG, t), t


def numpy_llava(t, ids, pixels):
    """transformers' LlavaForConditionalGeneration with strategy "full": hidden_states[-2]
    of the tower, every patch, through linear_1 -> GELU -> linear_2, at the image tokens."""
    t64 = ref.f64(t)
    feats = [ref.vision_tower(t, "siglip", SIGLIP, px.astype(np.float64), "vision_tower.", -2)
             for px in pixels]
    lin = lambda n, x: x @ t64[f"multi_modal_projector.{n}.weight"].T + t64[
        f"multi_modal_projector.{n}.bias"]
    image = [lin("linear_2", ref.ACT["gelu"](lin("linear_1", f))) for f in feats]
    llm = {"model." + k[len("language_model.model."):]: v for k, v in t.items()
           if k.startswith("language_model.model.")}
    llm["lm_head.weight"] = t["language_model.lm_head.weight"]
    embed = llm["model.embed_tokens.weight"].astype(np.float64)
    out = []
    for row, img in zip(ids, image):  # image features as extra embedding rows
        v = len(embed)
        table = np.concatenate([embed, img])
        toks = row.copy()
        toks[row == llava_tiny.IMAGE_TOKEN] = v + np.arange(len(img))
        out.append(ref.llm_logits(dict(llm, **{"model.embed_tokens.weight": table}),
                                  llava_tiny.TEXT, toks, 10000.0))
    return np.stack(out)


def test_siglip_llava_full_strategy_is_transformers(tmp_path):
    d, t = checkpoint(tmp_path / "l")
    model, cfg = hf.load(d)
    ids, pixels = llava_tiny.inputs()  # 16 image tokens: every 4 x 4 patch
    got = np.asarray(hf.hf_forward(model, input_ids=ids, pixel_values=pixels)["logits"])
    want = numpy_llava(t, ids, pixels)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    hf.save(model, cfg, tmp_path / "back")  # over the source: its config
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == CONFIG
    tower = cfg.encoder("vision").encoder
    whole = cfg.replace(encoders=(cfg.encoder("vision").__class__(
        "vision", tower.__class__(**{**tower.__dict__, "feature_layer": None}),
        cfg.encoder("vision").projector),))
    hf.save(MultimodalModel(whole, jax.random.key(0)), whole, tmp_path / "alone",
            image_token_index=llava_tiny.IMAGE_TOKEN)  # no source: the strategy it needs
    conf = json.loads((tmp_path / "alone" / "config.json").read_text())
    assert conf["vision_feature_select_strategy"] == "full"


@pytest.mark.parametrize("tower,strategy", [("siglip", "default"), ("clip", "full")])
def test_pairings_transformers_reads_otherwise_are_refused(tmp_path, tower, strategy):
    d = checkpoint(tmp_path / "l")[0] if tower == "siglip" else llava_tiny.write(tmp_path / "l")
    c = json.loads((d / "config.json").read_text())
    c["vision_feature_select_strategy"] = strategy
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=rf"^config.json vision_feature_select_strategy="
                                         rf"'{strategy}': mmjax supports '") as e:
        hf.load(d)
    assert "\n" not in str(e.value)
