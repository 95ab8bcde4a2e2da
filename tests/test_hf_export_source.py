"""Exports keep the source (issue 42): a Qwen2-VL run exported by scripts/export_hf.py's
`export_workdir` is its source checkpoint again, with the trained tensors in place: the
source's config.json (its token ids, text fields, layout: transformers 4 flat or 5 nested),
its processor / tokenizer files, its tensor names, its dtype (a bfloat16 source stays
bfloat16), the frozen tower byte for byte. Layout conversions keep every config field
(checked against the config.json each transformers wrote for the same model)."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from mmjax.errors import UserError
from mmjax.models import hf
from mmjax.models.config import with_overrides
from mmjax.models.hf.qwen2_vl_layouts import convert_config
from mmjax.models.mllm import MultimodalModel, trainable_filter
from mmjax.train import pretrained_sources
from mmjax.train.checkpoint import Checkpointer
from mmjax.train.export import export_workdir
from mmjax.train.logical_state import single_logical
from mmjax.train.optimizer import learning_rate_schedule, optimizer_from_settings
from mmjax.train.run_files import write_run_info
from mmjax.train.state import whole_model_state
from mmjax.train.step import split_model

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen2_vl")
SIDE = {"preprocessor_config.json": json.dumps({"min_pixels": 3136, "patch_size": 14}),
        "tokenizer_config.json": json.dumps({"model_max_length": 512}),
        "generation_config.json": json.dumps({"bos_token_id": 151643})}


def tensors(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def source(tmp_path, family, layout, bf16=False):
    """A copy of a fixture checkpoint (image_token_id 250, not Qwen's 151655) with processor,
    tokenizer and generation files; in bfloat16 (config.json saying so) if `bf16`."""
    d = tmp_path / f"{family}_{layout}{'_bf16' if bf16 else ''}"
    shutil.copytree(os.path.join(DATA, f"{family}_{layout}"), d)
    for name, text in SIDE.items():
        (d / name).write_text(text)
    if bf16:
        t = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors(d).items()}
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        c = json.loads((d / "config.json").read_text())
        c["dtype" if "text_config" in c else "torch_dtype"] = "bfloat16"
        (d / "config.json").write_text(json.dumps(c, indent=2))
    return d


def fake_run(workdir, src):
    """A run from `pretrained.model = src` with the tower frozen, its trainable arrays
    (LLM, merger) moved off the source as training would, checkpointed at step 2."""
    dirs = hf.expand_whole_model({"model": str(src)})
    _, cfg = hf.load(src)
    cfg = hf.prepare_pretrained(with_overrides(cfg, {"encoders.vision.frozen": True}), dirs)
    model = MultimodalModel(cfg, jax.random.key(0))
    hf.load_into_model(model, dirs["llm"], {"vision": dirs["vision"]})
    _, tr, _ = split_model(model, trainable_filter(cfg))
    tr = jax.tree.map(lambda a: a + 0.25, tr)
    tx = optimizer_from_settings(learning_rate_schedule(1))
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    ckpt.save(2, single_logical(whole_model_state(tr, tx.init(tr), jnp.ones((), jnp.int32))), {})
    ckpt.close()
    write_run_info(workdir, cfg, None, 0, dirs, pretrained_sources.record(dirs))
    return cfg, nnx.to_pure_dict(tr)


@pytest.mark.parametrize("layout", ["tf4", "tf5names"])
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_vl_run_exported_over_its_source(tmp_path, family, layout):
    src = source(tmp_path, family, layout)
    _, trained = fake_run(str(tmp_path / "run"), src)
    out = export_workdir(str(tmp_path / "run"), tmp_path / "out")["model"]
    assert json.loads((out / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())
    for name, text in SIDE.items():
        assert (out / name).read_text() == text, name
    got, want = tensors(out), tensors(src)
    assert sorted(got) == sorted(want)  # the source's names (legacy or module)
    tower = [k for k in want if "visual." in k and ".merger.mlp." not in k]
    assert tower and all(got[k].tobytes() == want[k].tobytes() for k in tower)
    model, _ = hf.load(out)
    np.testing.assert_array_equal(np.asarray(model.llm.embed[...]),
                                  np.asarray(trained["llm"]["embed"]))
    conf = json.loads((out / "config.json").read_text())
    assert conf["image_token_id"] == 250 and conf["video_token_id"] == 251


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_bf16_source_comes_back_bf16(tmp_path, family):
    src = source(tmp_path, family, "tf5", bf16=True)
    fake_run(str(tmp_path / "run"), src)
    out = export_workdir(str(tmp_path / "run"), tmp_path / "out")["model"]
    got, want = tensors(out), tensors(src)
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == ml_dtypes.bfloat16 for k in got)
    assert os.path.getsize(out / "model.safetensors") == os.path.getsize(src / "model.safetensors")
    tower = [k for k in want if k.startswith("visual.") and ".merger.mlp." not in k]
    assert all(got[k].tobytes() == want[k].tobytes() for k in tower)
    trained = [k for k in want if k.startswith("model.")]
    assert all(got[k].tobytes() != want[k].tobytes() for k in trained)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # hf.save of a model hf.load read (float32 in memory): the same dtype and bytes back
    model, cfg = hf.load(src)
    hf.save(model, cfg, tmp_path / "saved")
    again = tensors(tmp_path / "saved")
    assert all(again[k].dtype == want[k].dtype and again[k].tobytes() == want[k].tobytes()
               for k in want)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_layout_conversions_are_what_each_transformers_wrote(family):
    """The fixtures' tf4 and tf5 config.json were written by transformers 4.49 and 5.24 for
    the same model: converting one gives the other (all but transformers_version)."""
    tf4 = json.load(open(os.path.join(DATA, f"{family}_tf4", "config.json")))
    tf5 = json.load(open(os.path.join(DATA, f"{family}_tf5", "config.json")))
    for c, fmt, want in ((tf4, "nested", tf5), (tf5, "flat", tf4)):
        got = convert_config(c, fmt)
        got.pop("transformers_version")
        assert got == {k: v for k, v in want.items() if k != "transformers_version"}


def test_save_in_the_other_layout_keeps_fields_and_bytes(tmp_path):
    """A transformers-4 checkpoint saved in transformers 5's layout (and back): every
    config field converted, tensors renamed, bytes unchanged."""
    src = source(tmp_path, "qwen2_vl", "tf4")
    model, cfg = hf.load(src)
    hf.save(model, cfg, tmp_path / "v5", names="modules", config_format="nested")
    conf = json.loads((tmp_path / "v5" / "config.json").read_text())
    want = json.load(open(os.path.join(DATA, "qwen2_vl_tf5", "config.json")))
    conf.pop("transformers_version"), want.pop("transformers_version")
    assert conf == want
    names = tensors(os.path.join(DATA, "qwen2_vl_tf5names"))
    got = tensors(tmp_path / "v5")
    assert sorted(got) == sorted(names)
    assert all(got[k].tobytes() == names[k].tobytes() for k in names)
    v5, _ = hf.load(tmp_path / "v5")
    hf.save(v5, cfg, tmp_path / "v4", names="legacy", config_format="flat")
    assert json.loads((tmp_path / "v4" / "config.json").read_text()) == \
        json.loads((src / "config.json").read_text())
    assert (tmp_path / "v4" / "preprocessor_config.json").read_text() == \
        SIDE["preprocessor_config.json"]


def test_bf16_llava_trained_tensors_stay_bf16(tmp_path):
    """A bfloat16 LLaVA with its LLM trained: the changed tensors are written in bfloat16
    (the file its config.json says), the untouched tower byte for byte."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
    import hf_reference as ref
    import llava_tiny

    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in llava_tiny.tensors("tf5").items()}
    src = ref.write_checkpoint(tmp_path / "llava", dict(llava_tiny.CONFIG, dtype="bfloat16"), t)
    model, cfg = hf.load(src)
    state = nnx.state(model.llm, nnx.Param)
    nnx.update(model.llm, jax.tree.map(lambda a: a * 2, state))
    hf.save(model, cfg, tmp_path / "back")
    got = tensors(tmp_path / "back")
    assert sorted(got) == sorted(t) and all(got[k].dtype == ml_dtypes.bfloat16 for k in got)
    assert sum(a.nbytes for a in got.values()) == sum(a.nbytes for a in t.values())
    assert all(got[k].tobytes() == t[k].tobytes() for k in t if k.startswith("vision_tower."))
    llm = [k for k in t if k.startswith("language_model.") and k.endswith("proj.weight")]
    assert llm and all(got[k].tobytes() != t[k].tobytes() for k in llm)
    again, _ = hf.load(tmp_path / "back")
    np.testing.assert_array_equal(np.asarray(again.llm.embed[...]),
                                  np.asarray(model.llm.embed[...]))  # x2 is exact in bf16


def test_export_dtype_and_layout_when_asked(tmp_path):
    """export_hf.py --dtype / --layout: a float32 transformers-5 run written in bfloat16 and
    in transformers 4's layout (the tf4 fixture's config, all but the dtype and version)."""
    src = source(tmp_path, "qwen2_vl", "tf5names")
    fake_run(str(tmp_path / "run"), src)
    out = export_workdir(str(tmp_path / "run"), tmp_path / "out", dtype="bfloat16",
                         layout="tf4")["model"]
    got = tensors(out)
    assert sorted(got) == sorted(tensors(os.path.join(DATA, "qwen2_vl_tf4")))  # legacy names
    assert all(a.dtype == ml_dtypes.bfloat16 for a in got.values())
    conf = json.loads((out / "config.json").read_text())
    want = json.load(open(os.path.join(DATA, "qwen2_vl_tf4", "config.json")))
    assert conf.pop("torch_dtype") == "bfloat16" and want.pop("torch_dtype") == "float32"
    conf.pop("transformers_version"), want.pop("transformers_version")
    assert conf == want
    for bad, match in (({"dtype": "int8"}, r"^--dtype='int8': use one of"),
                       ({"layout": "tf6"}, r"^--layout='tf6': use one of")):
        with pytest.raises(UserError, match=match):
            export_workdir(str(tmp_path / "run"), tmp_path / "bad", **bad)


def test_bf16_tower_trained_over_its_source_stays_bf16(tmp_path):
    """A bfloat16 CLIP tower (any unit written over its source): trained tensors in
    bfloat16, untouched ones (post_layernorm, which the tower does not hold) byte for byte."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
    import hf_reference as ref
    from test_pretrained_training import CLIP

    t = {k: v.astype(ml_dtypes.bfloat16)
         for k, v in ref.tower_tensors("clip", CLIP, seed=3, std=0.1).items()}
    src = ref.write_checkpoint(tmp_path / "clip", CLIP, t)
    tower, cfg = hf.load(src)
    state = nnx.state(tower, nnx.Param)
    nnx.update(tower, jax.tree.map(lambda a: a * 2, state))
    hf.save(tower, cfg, tmp_path / "back")
    got = tensors(tmp_path / "back")
    assert sorted(got) == sorted(t) and all(a.dtype == ml_dtypes.bfloat16 for a in got.values())
    for k in t:
        if "post_layernorm" in k:
            assert got[k].tobytes() == t[k].tobytes()
        else:
            np.testing.assert_array_equal(got[k].astype(np.float32), 2 * t[k].astype(np.float32))
