"""transformers 5 file conventions: a `chat_template.jinja` beside tokenizer_config.json is
the tokenizer's chat template (it takes priority, as in transformers 5); images with
transparency are composited onto white before RGB, as HF's `convert_to_rgb` does
(pixel_values from transformers' CLIPImageProcessor in tests/data/llava_reference.npz)."""
import json
import os

import numpy as np
from PIL import Image

from mmjax.data.example_data import write_tokenizer
from mmjax.data.image_ops import convert_to_rgb
from mmjax.data.preprocess import ImageProcessor
from mmjax.data.tokenizer import Tokenizer

REF = np.load(os.path.join(os.path.dirname(__file__), "data", "llava_reference.npz"))
JINJA = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"


def test_chat_template_jinja_takes_priority(tmp_path):
    write_tokenizer(str(tmp_path), ["hello world", "the cat sat"] * 8, 320, template="plain")
    conf = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert Tokenizer(str(tmp_path)).chat_template == conf["chat_template"]
    (tmp_path / "chat_template.jinja").write_text(JINJA)
    tok = Tokenizer(str(tmp_path))
    assert tok.chat_template == JINJA
    del conf["chat_template"]  # transformers 5 writes the template only to the .jinja file
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(conf))
    assert Tokenizer(str(tmp_path)).chat_template == JINJA
    (tmp_path / "chat_template.jinja").unlink()  # a LLaVA processor's legacy file
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    assert Tokenizer(str(tmp_path)).chat_template == "{{ x }}"


def test_rgba_composited_onto_white_like_transformers():
    rgba = Image.fromarray(REF["rgba"], "RGBA")
    proc = ImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    np.testing.assert_allclose(proc(rgba), REF["rgba_pixel_values"], atol=1e-5)
    a = REF["rgba"].astype(np.float64)
    alpha = a[..., 3:] / 255
    want = np.round(a[..., :3] * alpha + 255 * (1 - alpha))  # over opaque white
    got = np.asarray(convert_to_rgb(rgba), np.float64)
    assert np.max(np.abs(got - want)) <= 1
    grey = Image.fromarray(REF["rgba"][..., 0], "L")
    assert convert_to_rgb(grey).tobytes() == grey.convert("RGB").tobytes()  # no alpha
