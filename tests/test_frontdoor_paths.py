"""Documented paths that must work as written: make_dataset.py's defaults fit the default
config, make_example_data.py writes a validation split, generate.py refuses a prompt
without the model's modality input."""
import importlib.util
import json
import os
import types

import pytest

from mmjax.errors import UserError
from mmjax.models.tiny import TINY_CONFIGS

REPO = os.path.join(os.path.dirname(__file__), os.pardir)


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_make_dataset_defaults_fit_the_default_config(tmp_path):
    """No flags but --out: the tiny model's patch size, grid, vocabulary, and image-text
    samples only (the tiny model has no audio encoder); the loader accepts the file."""
    from mmjax.data.records import ArrayRecordSource
    from mmjax.train.data_config import data_layout

    out = str(tmp_path / "tiny.arrayrecord")
    _script("make_dataset").main([f"--out={out}", "--num_samples=64"])
    src = ArrayRecordSource(out)
    cfg = TINY_CONFIGS["tiny"]()
    vision = cfg.encoders[0].encoder
    assert src.patch_size == vision.patch_size
    mods = {seg[0] for i in range(len(src)) for seg in src.spec(i)}
    assert "audio" not in mods and "image" in mods
    rules = data_layout(cfg).rules
    assert src.patch_size == rules.patch_size
    with pytest.raises(UserError, match="--kind=mix writes audio samples"):
        _script("make_dataset").main([f"--out={out}", "--kind=mix"])


def test_make_example_data_writes_a_validation_split(tmp_path):
    _script("make_example_data").main([f"--out={tmp_path}", "--num_samples=8", "--num_val=4"])
    with open(tmp_path / "val.json") as f:
        val = json.load(f)
    with open(tmp_path / "train.json") as f:
        train_ids = {r["id"] for r in json.load(f)}
    assert len(val) == 4 and not {r["id"] for r in val} & train_ids
    for r in val:
        assert os.path.isfile(tmp_path / "images" / r["image"])
        assert r["conversations"][0]["value"].startswith("<image>")


def test_generate_refuses_a_prompt_without_the_models_input():
    gen = _script("generate")
    cfg = TINY_CONFIGS["tiny"]()  # a vision encoder
    args = lambda **kw: types.SimpleNamespace(**{"image": None, "audio": None,
                                                  "text_only": False, "output_image": None,
                                                  **kw})
    with pytest.raises(UserError, match=r"^--image: model tiny reads images; pass --image=FILE"):
        gen.check_inputs(cfg, args())
    with pytest.raises(UserError, match="no audio encoder"):
        gen.check_inputs(cfg, args(image="x.png", audio="a.wav"))
    gen.check_inputs(cfg, args(image="x.png"))
    gen.check_inputs(cfg, args(text_only=True))
    gen.check_inputs(cfg, args(output_image="out.png"))  # drawing from text: no --image
