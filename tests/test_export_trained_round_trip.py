"""Real training, then export (issue 42): a run started from Hugging Face checkpoints trains
2 steps with the single-program step (trainer.train) and a frozen tower, is exported by
scripts/export_hf.py's `export_workdir`, and the export reloads (`hf.load`) to the trained
model's logits exactly, the frozen tower byte for byte the source's, the trained tensors
moved. One whole LLaVA (also exported in transformers 4's layout, --layout=tf4), one whole
Qwen2-VL, and one decoder family as the LLM of a run with a pretrained CLIP tower."""
import json
import os
import shutil
import sys

import gin
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import hf_reference as ref  # noqa: E402
from llava_families import llava_source, text_source  # noqa: E402
from test_pretrained_training import CLIP, base_cfg  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.config import with_overrides  # noqa: E402
from mmjax.models.hf.dispatch import _llm_logits  # noqa: E402
from mmjax.models.tiny import tiny_qwen2_vl  # noqa: E402
from mmjax.train.export import export_workdir, restore_model  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "data")
PROMPTS = np.load(os.path.join(DATA, "generate", "prompts.npz"))

pytestmark = pytest.mark.slow  # a real run each (compile + 2 steps): 8-10 s, 27 s in all


def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def trained_run(tmp_path, cfg, pretrained: dict) -> str:
    from mmjax.train.trainer import train
    run = str(tmp_path / "run")
    gin.clear_config()
    gin.parse_config([f"pretrained.{k} = '{v}'" for k, v in pretrained.items()])
    try:
        train(run, model=cfg, steps=2, global_batch=4, progress=False, checkpoint_every=2)
    finally:
        gin.clear_config()
    return run


def check_moved_and_frozen(got: dict, src: dict, is_frozen):
    assert sorted(got) == sorted(src)
    frozen = [k for k in src if is_frozen(k)]
    assert all(got[k].tobytes() == src[k].tobytes() for k in frozen)
    moved = [k for k in src if not is_frozen(k) and got[k].tobytes() != src[k].tobytes()]
    assert len(moved) > len(src) // 4  # training moved the trainable tensors


def inputs(case):
    return {k.split("/", 1)[1]: PROMPTS[k] for k in PROMPTS.files if k.startswith(case + "/")}


def test_llava_trained_exported_in_both_layouts(tmp_path):
    src, t, conf, _ = llava_source(tmp_path / "src", "qwen3", "clip")
    cfg = with_overrides(base_cfg(), {"encoders.vision.frozen": True})
    cfg = cfg.replace(encoders=tuple(e for e in cfg.encoders if e.name == "vision"))
    run = trained_run(tmp_path, cfg, {"model": src})
    _, model, _, _ = restore_model(run)
    model.hf_image_token = 27
    x = inputs("llava_qwen3")
    want = np.asarray(hf.hf_forward(model, **x)["logits"])
    for layout in (None, "tf4"):
        out = tmp_path / f"out_{layout}"
        export_workdir(run, out, layout=layout)
        got = tensors(out / "model")
        if layout is None:
            assert json.loads((out / "model" / "config.json").read_text()) == conf
            check_moved_and_frozen(got, t, lambda k: k.startswith("vision_tower."))
        else:
            assert all(k.startswith(("vision_tower.vision_model.", "multi_modal_projector.",
                                     "language_model.")) for k in got)
        again, _ = hf.load(out / "model")
        np.testing.assert_array_equal(np.asarray(hf.hf_forward(again, **x)["logits"]), want)


def test_qwen2_vl_trained_exported_over_its_source(tmp_path):
    from helpers import make_cfg
    src = tmp_path / "qwen2_vl"
    shutil.copytree(os.path.join(DATA, "qwen2_vl", "qwen2_vl_tf5"), src)
    cfg = with_overrides(make_cfg(tiny_qwen2_vl), {"encoders.vision.frozen": True})
    run = trained_run(tmp_path, cfg, {"model": src})
    export_workdir(run, tmp_path / "out")
    out = tmp_path / "out" / "model"
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())
    # the merger's MLP is the (trained) projector; the rest of visual.* the frozen tower
    check_moved_and_frozen(tensors(out), tensors(src), lambda k: k.startswith("visual.")
                           and not k.startswith("visual.merger.mlp."))
    again, _ = hf.load(out)
    _, model, _, _ = restore_model(run)
    model.hf_source = again.hf_source  # its image token id
    x = inputs("qwen2_vl")
    np.testing.assert_array_equal(np.asarray(hf.hf_forward(again, **x)["logits"]),
                                  np.asarray(hf.hf_forward(model, **x)["logits"]))


def test_family_llm_trained_exported_over_its_source(tmp_path):
    src, conf = text_source(tmp_path / "llm", "gemma2")
    clip = ref.write_checkpoint(tmp_path / "clip", CLIP,
                                ref.tower_tensors("clip", CLIP, seed=2, std=0.1))
    cfg = with_overrides(base_cfg(), {"encoders.vision.frozen": True})
    run = trained_run(tmp_path, cfg, {"llm": src, "vision": clip})
    export_workdir(run, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "llm" / "config.json").read_text()) == conf
    assert tensors(tmp_path / "out" / "vision").keys() == tensors(clip).keys()
    assert all(a.tobytes() == tensors(clip)[k].tobytes()
               for k, a in tensors(tmp_path / "out" / "vision").items())  # frozen tower
    check_moved_and_frozen(tensors(tmp_path / "out" / "llm"), tensors(src), lambda k: False)
    _, model, _, _ = restore_model(run)
    again, _ = hf.load(tmp_path / "out" / "llm")
    tokens = jnp.asarray([[1, 5, 9, 3, 17, 22, 4, 8]])
    allowed = jnp.tril(jnp.ones((8, 8), bool))[None]
    np.testing.assert_array_equal(np.asarray(hf.hf_forward(again, input_ids=tokens)["logits"]),
                                  np.asarray(_llm_logits(model.llm, tokens, allowed)))
