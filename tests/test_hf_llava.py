"""Whole LlavaForConditionalGeneration checkpoints: `hf.load` in each transformers layout,
`hf_forward` against transformers' float32 logits (tests/data/llava_reference.npz, made by
tests/fixtures/make_llava_reference.py), `hf.save` writing the source's names and shapes (or
transformers 5's without a source) and loading back to the same logits, and one-line
refusals naming the config field."""
import json
import os
import sys

import numpy as np
import pytest
from safetensors import safe_open

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "fixtures"))
import llava_tiny  # noqa: E402
from jitted import call  # noqa: E402
from mmjax.models import hf  # noqa: E402
from mmjax.models.mllm import MultimodalModel  # noqa: E402

REF = np.load(os.path.join(os.path.dirname(__file__), "data", "llava_reference.npz"))


def shapes(d):
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "np") as st:
                out.update({k: list(st.get_slice(k).get_shape()) for k in st.keys()})
    return out


def rel_err(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("llava")
    out = {}
    for layout in ("tf4", "tf452", "tf5"):
        model, cfg = hf.load(llava_tiny.write(root / layout, layout))
        out[layout] = (root / layout, model, cfg)
    return out


@pytest.mark.parametrize("layout", ["tf4", "tf452", "tf5"])
def test_logits_match_transformers(loaded, layout):
    _, model, cfg = loaded[layout]
    assert isinstance(model, MultimodalModel)
    assert cfg.image_attention == "causal" and not cfg.modality_markers
    assert cfg.encoder("vision").projector.act == "gelu"
    assert cfg.encoder("vision").encoder.feature_layer == -2
    got = np.asarray(hf.hf_forward(model, input_ids=REF["input_ids"],
                                   pixel_values=REF["pixel_values"])["logits"])
    assert got.shape == REF["logits"].shape
    assert rel_err(got, REF["logits"]) < 1e-4


@pytest.mark.parametrize("layout", ["tf4", "tf452", "tf5"])
def test_save_reproduces_source_names_and_reloads(loaded, tmp_path, layout):
    src, model, cfg = loaded[layout]
    hf.save(model, cfg, tmp_path / "out")
    assert shapes(tmp_path / "out") == shapes(src)
    again, _ = hf.load(tmp_path / "out")
    got = np.asarray(hf.hf_forward(again, input_ids=REF["input_ids"],
                                   pixel_values=REF["pixel_values"])["logits"])
    assert rel_err(got, REF["logits"]) < 1e-4


def test_save_without_source_writes_transformers5_names(loaded, tmp_path):
    src, model, cfg = loaded["tf4"]
    # a model built in mmjax (no source): the tower must hold all its layers
    whole = cfg.replace(encoders=(cfg.encoder("vision").__class__(
        "vision", cfg.encoder("vision").encoder.__class__(
            **{**cfg.encoder("vision").encoder.__dict__, "feature_layer": None}),
        cfg.encoder("vision").projector),))
    mdl = MultimodalModel(whole, __import__("jax").random.key(0))
    with pytest.raises(ValueError, match="^llava: save without a source needs image_token_index"):
        hf.save(mdl, whole, tmp_path / "x")
    hf.save(mdl, whole, tmp_path / "out", image_token_index=llava_tiny.IMAGE_TOKEN)
    want = json.loads(str(REF["tf5_shapes"]))
    assert shapes(tmp_path / "out") == want
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    tf5 = json.loads(str(REF["tf5_config"]))
    for key in ("model_type", "image_token_index", "projector_hidden_act",
                "vision_feature_select_strategy"):
        assert written[key] == tf5[key], key
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "num_key_value_heads"):
        assert written["text_config"][key] == tf5["text_config"][key], key
    assert written["vision_config"]["num_hidden_layers"] == tf5["vision_config"]["num_hidden_layers"]


@pytest.mark.parametrize("field,value,match", [
    ("vision_feature_select_strategy", "full", "'default' with a clip_vision_model tower"),
    ("vision_feature_layer", [-2, -1], "one layer"),
    ("vision_feature_layer", 0, "a layer's output"),
    ("projector_hidden_act", "relu", "gelu"),
    ("multimodal_projector_bias", False, "with biases"),
])
def test_refusals_name_the_field(tmp_path, field, value, match):
    d = llava_tiny.write(tmp_path / "l")
    c = json.loads((d / "config.json").read_text())
    c[field] = value
    (d / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match=rf"^config.json {field}=.*: mmjax supports .*{match}") as e:
        hf.load(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("semantics", ["llava", "mmjax"])
def test_training_path_has_llava_semantics(loaded, semantics):
    """A sample assembled for training (image tokens causal, no markers, exact-GELU
    projector) gives the loss of transformers' logits; mmjax's bidirectional image mask with
    markers, still available, does not."""
    import jax
    from flax import nnx

    from mmjax.data.assemble import assemble
    from mmjax.data.sample import Sample, Segment, SpecialTokens
    from mmjax.train.data_config import data_layout
    from mmjax.train.inputs import model_inputs

    _, model, cfg = loaded["tf4"]
    if semantics == "mmjax":
        cfg = cfg.replace(image_attention="bidirectional", modality_markers=True)
        shaped = nnx.eval_shape(lambda: MultimodalModel(cfg, jax.random.key(0)))
        model = nnx.merge(nnx.graphdef(shaped), nnx.state(model))
    ids, pixels = REF["input_ids"][0], REF["pixel_values"][0]
    special = SpecialTokens(bos=int(ids[0]), eos=int(ids[-1]), first_text=0,
                            image_start=120, image_end=121)
    sample = Sample(0, (Segment("text", ids[1:3].astype(np.int32)),
                        Segment("image", np.ascontiguousarray(pixels.transpose(1, 2, 0))),
                        Segment("text", ids[19:23].astype(np.int32))))
    layout = data_layout(cfg, seq_len=32, vision_caps=(16,), special=special)
    batch = model_inputs(assemble([sample], layout))
    loss, _ = call(model, batch)
    logits = REF["logits"][0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    scored = [0, 1, 18, 19, 20, 21, 22]  # positions whose next token is text
    want = -np.mean([logp[p, ids[p + 1]] for p in scored])
    if semantics == "llava":
        np.testing.assert_array_equal(np.asarray(batch["tokens"][0, :24] != 0),
                                      ids != llava_tiny.IMAGE_TOKEN)
        assert abs(float(loss) - want) / want < 1e-5
    else:
        assert abs(float(loss) - want) / want > 1e-3


def test_positive_feature_layer_is_hidden_states_index(tmp_path):
    d = llava_tiny.write(tmp_path / "l")
    c = json.loads((d / "config.json").read_text())
    c["vision_feature_layer"] = 2  # hidden_states[2] of 3 layers = hidden_states[-2]
    (d / "config.json").write_text(json.dumps(c))
    model, cfg = hf.load(d)
    assert cfg.encoder("vision").encoder.feature_layer == -2
    got = np.asarray(hf.hf_forward(model, input_ids=REF["input_ids"],
                                   pixel_values=REF["pixel_values"])["logits"])
    assert rel_err(got, REF["logits"]) < 1e-4
