"""Qwen2-VL / Qwen2.5-VL against transformers 5 (fixtures from
tests/fixtures/make_qwen2vl_reference.py; no torch here): logits of whole checkpoints in
three layouts, save round trips, the processor on real PNGs, the window partition, M-RoPE
positions, refusals."""
import copy
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from PIL import Image
from safetensors import safe_open

from mmjax.data.preprocess import load_processor
from mmjax.data.qwen2_vl_processor import Qwen2VLImageProcessor
from mmjax.errors import UserError
from mmjax.models import hf
from mmjax.models.config import LLMConfig
from mmjax.models.hf.qwen2_vl import qwen2_vl_config_from_hf
from mmjax.models.qwen2_vl_config import mrope_positions, patch_positions
from mmjax.models.qwen2_vl_vision import window_segments

DATA = os.path.join(os.path.dirname(__file__), "data", "qwen2_vl")
FAMILIES = ("qwen2_vl", "qwen2_5_vl")
LAYOUTS = ("tf5", "tf5names", "tf4")  # save_pretrained / module names / transformers 4


def _dir(family, layout):
    return os.path.join(DATA, f"{family}_{layout}")


@pytest.fixture(scope="module")
def loaded():
    return {(f, lay): hf.load(_dir(f, lay)) for f in FAMILIES for lay in LAYOUTS}


def _pure(model):
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _tensors(d):
    with safe_open(os.path.join(d, "model.safetensors"), "numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _forward(model, ref):
    return np.asarray(hf.hf_forward(
        model, input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
        pixel_values=ref["pixel_values"].astype(np.float32),
        image_grid_thw=ref["image_grid_thw"],
        mm_token_type_ids=ref["mm_token_type_ids"])["logits"])


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(loaded, family):
    """Two images of different sizes in a row, a left-padded second row: float32 logits
    within 1e-4 relative of transformers 5's (at every attended position). The three
    layouts load to bit-identical parameters, so they give the same logits."""
    ref = np.load(os.path.join(DATA, f"{family}_logits.npz"))
    model, cfg = loaded[(family, "tf5")]
    got = _forward(model, ref)
    keep = ref["attention_mask"].astype(bool)
    err = np.abs(got[keep] - ref["logits"][keep]).max() / np.abs(ref["logits"][keep]).max()
    assert err < 1e-4, err
    base = _pure(model)
    for layout in LAYOUTS[1:]:
        other, other_cfg = loaded[(family, layout)]
        assert other_cfg == cfg
        jax.tree.map(np.testing.assert_array_equal, _pure(other), base)


def test_window_attention_is_used(loaded):
    """Qwen2.5-VL's window blocks change the result: full attention everywhere differs
    from transformers by far more than the tolerance (so the parity above tests windows)."""
    ref = np.load(os.path.join(DATA, "qwen2_5_vl_logits.npz"))
    model, cfg = loaded[("qwen2_5_vl", "tf5")]
    vis = cfg.encoder("vision").encoder
    assert vis.window_size == 56 and vis.fullatt_block_indexes == (1, 3)
    full = dataclasses.replace(vis, fullatt_block_indexes=tuple(range(vis.num_layers)))
    tower = model.encoders["vision"]
    tower.cfg = full
    try:
        got = _forward(model, ref)
    finally:
        tower.cfg = vis
    keep = ref["attention_mask"].astype(bool)
    assert np.abs(got[keep] - ref["logits"][keep]).max() / np.abs(ref["logits"][keep]).max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_save_round_trip_exact(loaded, tmp_path, family, layout):
    """save writes the source's tensor names, shapes, dtypes and values and its config.json
    exactly; the saved directory loads again to the same parameters."""
    model, cfg = loaded[(family, layout)]
    hf.save_qwen2_vl(model, cfg, tmp_path)
    src, out = _tensors(_dir(family, layout)), _tensors(tmp_path)
    assert sorted(src) == sorted(out)
    for k in src:
        assert src[k].dtype == out[k].dtype and np.array_equal(src[k], out[k]), k
    assert (json.loads((tmp_path / "config.json").read_text())
            == json.load(open(os.path.join(_dir(family, layout), "config.json"))))
    again, again_cfg = hf.load(tmp_path)
    assert again_cfg == cfg
    jax.tree.map(np.testing.assert_array_equal, _pure(again), _pure(model))


def test_save_without_source_is_save_pretrained_layout(tmp_path):
    """A model built in mmjax (no source checkpoint) is written as transformers 5's
    save_pretrained writes it: legacy names (as the tf5 fixture), nested config."""
    model, cfg = hf.load(_dir("qwen2_5_vl", "tf4"))
    model.hf_source = "null"  # as a model built in mmjax has no source
    hf.save_qwen2_vl(model, cfg, tmp_path)
    src, out = _tensors(_dir("qwen2_5_vl", "tf5")), _tensors(tmp_path)
    assert {k: v.shape for k, v in src.items()} == {k: v.shape for k, v in out.items()}
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert conf["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert qwen2_vl_config_from_hf(conf) == cfg


@pytest.mark.parametrize("tag,kw", [("default", {}),
                                     ("small", {"size": {"shortest_edge": 3136,
                                                         "longest_edge": 28 * 28 * 16}})])
def test_processor_equals_transformers(tag, kw):
    """pixel_values and image_grid_thw bit-equal to transformers 5's Qwen2VLImageProcessor
    on two real PNGs (542 x 130 and 128 x 128), with the default and a small max_pixels."""
    ref = np.load(os.path.join(DATA, "processor.npz"))
    images = [Image.open(os.path.join(DATA, f"image_{c}.png")) for c in "ab"]
    out = Qwen2VLImageProcessor(**kw).preprocess(images)
    np.testing.assert_array_equal(out["image_grid_thw"], ref[f"{tag}_image_grid_thw"])
    assert out["pixel_values"].dtype == np.float32
    np.testing.assert_array_equal(out["pixel_values"], ref[f"{tag}_pixel_values"])
    assert isinstance(load_processor(DATA), Qwen2VLImageProcessor)


def _hf_windows(gh, gw, merge, side):
    """Port of transformers' get_vision_window_index for one image: window id per patch in
    the processor's order."""
    lh, lw = gh // merge, gw // merge
    w = side // merge
    ph, pw = w - lh % w, w - lw % w
    idx = np.pad(np.arange(lh * lw).reshape(lh, lw), ((0, ph), (0, pw)), constant_values=-1)
    nh, nw = (lh + ph) // w, (lw + pw) // w
    win = np.full(lh * lw, -1)
    blocks = idx.reshape(nh, w, nw, w).transpose(0, 2, 1, 3).reshape(nh * nw, -1)
    for k, block in enumerate(blocks):
        win[block[block >= 0]] = k
    return np.repeat(win, merge * merge)  # a merged token's patches are consecutive


@pytest.mark.parametrize("grid", [(6, 10), (8, 8), (2, 4), (12, 6)])
def test_window_segments_partition_like_transformers(grid):
    gh, gw = grid
    pos = patch_positions(gh, gw, 2)
    seg = window_segments(np.ones((1, gh * gw), np.int32), pos[None], 4)[0]
    ref = _hf_windows(gh, gw, 2, 4)
    same = lambda a: a[:, None] == a[None, :]
    np.testing.assert_array_equal(same(np.asarray(seg)), same(ref))


def test_mrope_positions_get_rope_index():
    """HF get_rope_index on a hand-worked row: 2 text, a 4 x 6 patch image (2 x 3 merged
    tokens), 2 text; padded row kept at 0."""
    ids = np.array([[0, 5, 6, 9, 9, 9, 9, 9, 9, 7, 8]])
    mm = (ids == 9).astype(np.int32)
    mask = np.array([[0] + [1] * 10])
    pos = mrope_positions(ids, mm, [[1, 4, 6]], 2, mask)[0]
    expect = [[0, 0, 0], [0, 0, 0], [1, 1, 1],
              [2, 2, 2], [2, 2, 3], [2, 2, 4], [2, 3, 2], [2, 3, 3], [2, 3, 4],
              [5, 5, 5], [6, 6, 6]]
    np.testing.assert_array_equal(pos, expect)


def _refusal(mutate):
    c = json.load(open(os.path.join(_dir("qwen2_5_vl", "tf5"), "config.json")))
    mutate(c)
    with pytest.raises((ValueError, UserError)) as err:
        qwen2_vl_config_from_hf(c)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_refusals_name_the_field():
    assert "rope_type" in _refusal(
        lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn"))
    assert "out_hidden_size" in _refusal(lambda c: c["vision_config"].update(out_hidden_size=32))
    assert "use_sliding_window" in _refusal(
        lambda c: c["text_config"].update(use_sliding_window=True))
    assert "hidden_act" in _refusal(lambda c: c["vision_config"].update(hidden_act="relu6"))
    assert "window_size" in _refusal(lambda c: c["vision_config"].update(window_size=50))
    assert "patch_size" in _refusal(lambda c: c["vision_config"].update(patch_size=[14, 16]))
    with pytest.raises(UserError, match="mrope_section"):
        LLMConfig(vocab_size=8, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
                  ffn_size=8, mrope_section=(2, 3, 2))


def test_video_inputs_refused(loaded):
    model, _ = loaded[("qwen2_vl", "tf5")]
    ref = np.load(os.path.join(DATA, "qwen2_vl_logits.npz"))
    grids = copy.deepcopy(ref["image_grid_thw"])
    grids[0, 0] = 2
    with pytest.raises(ValueError, match="t=2"):
        hf.hf_forward(model, input_ids=ref["input_ids"], pixel_values=ref["pixel_values"],
                      image_grid_thw=grids)


def test_export_model_writes_whole_checkpoint(loaded, tmp_path):
    """scripts/export_hf.py's export of a Qwen2-VL-shaped run: one whole checkpoint in
    out/model with transformers 5's save_pretrained names, loading back to the same
    parameters."""
    from mmjax.train.export import export_model

    model, cfg = loaded[("qwen2_vl", "tf5names")]
    written = export_model(cfg, _pure(model), tmp_path)
    assert written == {"model": tmp_path / "model"}
    src, out = _tensors(_dir("qwen2_vl", "tf5")), _tensors(tmp_path / "model")
    assert sorted(src) == sorted(out)
    assert all(np.array_equal(src[k], out[k]) for k in src)
    again, again_cfg = hf.load(tmp_path / "model")
    assert again_cfg == cfg
