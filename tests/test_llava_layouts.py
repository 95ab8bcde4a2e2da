"""LLaVA in transformers 4's and 5's layouts (llava_layouts.py): a transformers-4 LLaVA is
written back in its own layout (names, config.json, tower byte for byte), and `hf.save(...,
layout=)` converts either way to exactly what the other layout's fixture holds (tensor names
and config.json: the family fixtures' config_v4 / config_v5), reloading to the same logits."""
import json
import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
from llava_families import llava_source  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.hf.llava_layouts import convert_llava_config  # noqa: E402

CASES = ("gemma3", "phi3")  # per-layer-type RoPE + rope_scaling; fused Phi-3, partial RoPE


def trained(src):
    model, cfg = hf.load(src)
    state = nnx.state(model.llm, nnx.Param)
    nnx.update(model.llm, jax.tree.map(lambda a: a + 0.5, state))  # trained; tower frozen
    return model, cfg


def logits(model, tokens):
    ids = np.concatenate([tokens, np.full(16, 27)])[None]
    pixels = np.random.default_rng(6).normal(size=(1, 3, 16, 16)).astype(np.float32)
    return np.asarray(hf.hf_forward(model, input_ids=ids, pixel_values=pixels)["logits"])


@pytest.mark.parametrize("case", CASES)
def test_tf4_llava_written_back_in_its_own_layout(tmp_path, case):
    src, t, conf, tokens = llava_source(tmp_path / "src", case, "clip", layout="tf4")
    model, cfg = trained(src)
    hf.save(model, cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == conf
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(t)
    assert all(got[k].tobytes() == t[k].tobytes() for k in t if k.startswith("vision_tower."))
    again, _ = hf.load(tmp_path / "out")
    np.testing.assert_array_equal(logits(again, tokens), logits(model, tokens))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("src_layout,dst_layout", [("tf4", "tf5"), ("tf5", "tf4")])
def test_layout_conversion_is_the_other_fixture(tmp_path, case, src_layout, dst_layout):
    src, t, _, tokens = llava_source(tmp_path / "src", case, "clip", layout=src_layout)
    _, t_dst, conf_dst, _ = llava_source(tmp_path / "dst", case, "clip", layout=dst_layout)
    model, cfg = trained(src)
    hf.save(model, cfg, tmp_path / "out", layout=dst_layout)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == conf_dst
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(got) == sorted(t_dst)
    tower = [k for k in t_dst if k.startswith("vision_tower.")]
    assert all(got[k].tobytes() == t_dst[k].tobytes() for k in tower)  # frozen: the bytes
    again, _ = hf.load(tmp_path / "out")
    np.testing.assert_array_equal(logits(again, tokens), logits(model, tokens))


def test_config_conversion_round_trips_and_names_the_dtype():
    z = np.load(os.path.join(os.path.dirname(__file__), "data", "families", "gemma3.npz"))
    v4 = {"model_type": "llava", "torch_dtype": "bfloat16",
          "text_config": dict(json.loads(str(z["config_v4"])), torch_dtype="bfloat16")}
    v5 = convert_llava_config(v4, "tf5")
    assert v5["dtype"] == v5["text_config"]["dtype"] == "bfloat16" and "torch_dtype" not in v5
    assert v5["text_config"]["rope_parameters"] == \
        json.loads(str(z["config_v5"]))["rope_parameters"]
    assert convert_llava_config(v5, "tf4") == v4
    with pytest.raises(ValueError, match="layout='tf3': use one of tf4, tf5"):
        convert_llava_config(v4, "tf3")
