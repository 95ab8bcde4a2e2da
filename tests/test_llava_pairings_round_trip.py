"""Every LLaVA text / vision pairing the loader accepts round-trips over its source (issue 42):
each decoder family of tests/data/families as LLaVA's text model, under a CLIP ("default")
or SigLIP ("full") tower; the LLM trained (moved off the source), the tower frozen; the saved
checkpoint (as export_hf.py writes a `pretrained.model` LLaVA run) holds the source's names,
shapes, dtypes and config.json, the tower byte for byte, and reloads to the same logits."""
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
from test_decoder_families import CASES  # noqa: E402
from mmjax.models import hf  # noqa: E402


@pytest.mark.parametrize("tower", ["clip", "siglip"])
@pytest.mark.parametrize("case", CASES)
def test_llava_pairing_saved_over_its_source(tmp_path, case, tower):
    src, t, conf, tokens = llava_source(tmp_path / "src", case, tower)
    model, cfg = hf.load(src)
    state = nnx.state(model.llm, nnx.Param)
    nnx.update(model.llm, jax.tree.map(lambda a: a + 0.5, state))  # trained; tower frozen
    ids = np.concatenate([tokens, np.full(16, 27)])[None]
    pixels = np.random.default_rng(6).normal(size=(1, 3, 16, 16)).astype(np.float32)
    want = np.asarray(hf.hf_forward(model, input_ids=ids, pixel_values=pixels)["logits"])
    hf.save(model, cfg, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == conf
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {k: (v.shape, v.dtype) for k, v in got.items()} == \
        {k: (v.shape, v.dtype) for k, v in t.items()}
    assert all(got[k].tobytes() == t[k].tobytes() for k in t if not k.startswith("language_"))
    assert all(got[k].tobytes() != t[k].tobytes() for k in t if k.startswith("language_"))
    again, _ = hf.load(tmp_path / "out")
    np.testing.assert_array_equal(
        np.asarray(hf.hf_forward(again, input_ids=ids, pixel_values=pixels)["logits"]), want)
