"""`hf.load` + `hf_forward` for every supported family against float64 NumPy re-implementations
of the HF reference models (tests/hf_reference.py), from tiny checkpoints written here with
HF tensor names: both config layouts, sharded directories, refusals, export round trips."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

import hf_reference as ref
from mmjax.errors import UserError
from mmjax.models import hf

RTOL = 1e-4

LLAMA31 = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 29,
           "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 40, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 64}
# Small original context so that all three llama3 bands (kept, blended, divided) occur.
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
V4 = dict(LLAMA31, rope_theta=500.0, rope_scaling=dict(LLAMA3_SCALING, rope_type="llama3"))
V5 = dict(LLAMA31, rope_parameters=dict(LLAMA3_SCALING, rope_type="llama3", rope_theta=500.0))
QWEN2_V5 = dict(LLAMA31, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
                tie_word_embeddings=True, use_sliding_window=False, sliding_window=32,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
MISTRAL = dict(LLAMA31, model_type="mistral", architectures=["MistralForCausalLM"], head_dim=12,
               sliding_window=None, rope_theta=1e4)
CLIP_V = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_channels": 3, "image_size": 12, "patch_size": 4,
          "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
SIGLIP_V = dict(CLIP_V, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, patch_size=3)
WHISPER = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
           "d_model": 16, "encoder_layers": 2, "encoder_attention_heads": 2,
           "encoder_ffn_dim": 24, "num_mel_bins": 6, "max_source_positions": 5,
           "activation_function": "gelu", "scale_embedding": False}
TOKENS = np.array([[3, 9, 1, 28, 0, 7, 7, 15, 4, 20, 11, 2]])


def assert_close(got, want):
    got = np.asarray(got, np.float64)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * np.abs(want).max())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, cfg, shards in (("v4", V4, 1), ("v5", V5, 3), ("qwen2", QWEN2_V5, 2),
                              ("mistral", MISTRAL, 1)):
        t = ref.llm_tensors(cfg, seed=len(name))
        out[name] = (ref.write_checkpoint(root / name, cfg, t, shards), t)
    clip = {"model_type": "clip", "architectures": ["CLIPModel"], "vision_config": CLIP_V,
            "text_config": {"hidden_size": 8}}
    t = ref.tower_tensors("clip", CLIP_V, seed=5)
    t["text_model.embeddings.token_embedding.weight"] = np.zeros((4, 8), np.float32)
    t["visual_projection.weight"] = np.zeros((8, 16), np.float32)
    out["clip"] = (ref.write_checkpoint(root / "clip", clip, t, 2), t)
    siglip = dict(SIGLIP_V, model_type="siglip_vision_model")
    t = ref.tower_tensors("siglip", SIGLIP_V, seed=6)
    t["vision_model.head.probe"] = np.zeros((1, 1, 16), np.float32)  # pooling head: left alone
    out["siglip"] = (ref.write_checkpoint(root / "siglip", siglip, t), t)
    t = ref.whisper_tensors(WHISPER, seed=7)
    t["model.decoder.layers.0.fc1.weight"] = np.zeros((3, 3), np.float32)
    out["whisper"] = (ref.write_checkpoint(root / "whisper", WHISPER, t), t)
    return out


# ----------------------------------------------------------------------------- LLMs


def test_both_config_layouts_read_the_same():
    a, b = hf.config_from_hf(V4), hf.config_from_hf(V5)
    assert a == b and a.rope_theta == 500.0 and a.rope_scaling == ("llama3", 8.0, 1.0, 4.0, 64)
    q4 = dict(QWEN2_V5, rope_theta=1e6)
    del q4["rope_parameters"]
    assert hf.config_from_hf(q4) == hf.config_from_hf(QWEN2_V5)
    assert hf.config_from_hf(QWEN2_V5).rope_theta == 1e6  # not the 10000 default
    legacy_key = dict(V4, rope_scaling=dict(LLAMA3_SCALING, type="llama3"))
    assert hf.config_from_hf(legacy_key) == a


def test_llama3_inv_freq_has_all_three_bands():
    from mmjax.models.layers import rope_inv_freq
    got = np.asarray(rope_inv_freq(8, 500.0, ("llama3", 8.0, 1.0, 4.0, 64)))
    plain = ref.inv_freq(8, 500.0)
    want = ref.inv_freq(8, 500.0, LLAMA3_SCALING)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    kept, divided = np.isclose(want, plain), np.isclose(want, plain / 8)
    assert kept.any() and divided.any() and (~kept & ~divided).any()


@pytest.mark.parametrize("name", ["v4", "v5", "qwen2", "mistral"])
def test_llm_logits_match_hf_reference(ckpts, name):
    path, t = ckpts[name]
    module, cfg = hf.load(path)
    c = json.loads((path / "config.json").read_text())
    theta, scaling = hf.rope_from_hf(c)
    scaling = None if scaling is None else LLAMA3_SCALING
    got = hf.hf_forward(module, input_ids=TOKENS)["logits"][0]
    assert_close(got, ref.llm_logits(t, c, TOKENS[0], theta, scaling))
    if name == "qwen2":
        assert cfg.qkv_bias and cfg.tie_embeddings and module.lm_head is None


def test_llm_attention_mask_hides_padding(ckpts):
    module, _ = hf.load(ckpts["v4"][0])
    mask = np.ones_like(TOKENS)
    mask[0, 3] = 0  # a padded key: later queries must not see it
    a = np.asarray(hf.hf_forward(module, input_ids=TOKENS, attention_mask=mask)["logits"])
    b = np.asarray(hf.hf_forward(module, input_ids=TOKENS)["logits"])
    np.testing.assert_array_equal(a[0, :3], b[0, :3])
    assert np.abs(a[0, 4:] - b[0, 4:]).max() > 1e-3


@pytest.mark.parametrize("field,value,match", [
    ("rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0},
     "rope_type='longrope'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_type='dynamic'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("attention_bias", True, "attention_bias=True"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("model_type", "gemma", "model_type='gemma'"),
])
def test_llm_refusals_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(dict(LLAMA31, **{field: value}))


def test_sliding_window_read_only_when_in_use():
    """Windows are modelled now (tests/test_decoder_families.py checks them against
    transformers); here: Mistral's and Qwen2's switches."""
    assert hf.config_from_hf(dict(MISTRAL, sliding_window=16)).sliding_window == 16
    assert hf.config_from_hf(MISTRAL).sliding_window is None  # null: no window
    assert hf.config_from_hf(QWEN2_V5).sliding_window is None  # use_sliding_window False
    on = hf.config_from_hf(dict(QWEN2_V5, use_sliding_window=True, max_window_layers=1))
    assert on.sliding_window == 32 and on.sliding_layers == (False, True)


def test_unsupported_architecture_and_missing_config(tmp_path):
    with pytest.raises(ValueError, match=r"model_type='bert'.*supported: llama"):
        hf.model_type({"model_type": "bert"})
    assert hf.model_type({"architectures": ["Qwen2ForCausalLM"]}) == "qwen2"
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.load(tmp_path)


def test_missing_shard_and_wrong_shape(ckpts, tmp_path):
    path, t = ckpts["v5"]
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        hf.load(tmp_path)
    bad = dict(V5, intermediate_size=41)  # the checkpoint does not match the config
    ref.write_checkpoint(tmp_path / "bad", bad, t)
    with pytest.raises(ValueError, match=r"has shape \(40, 32\), expected \(41, 32\)"):
        hf.load(tmp_path / "bad")


# ----------------------------------------------------------------------- vision towers


@pytest.mark.parametrize("family,size", [("clip", (12, 12)), ("clip", (16, 8)),
                                         ("siglip", (16, 8))],
                         ids=["clip-native", "clip-interpolated", "siglip-interpolated"])
def test_vision_tower_matches_hf_reference(ckpts, family, size):
    path, t = ckpts[family]
    module, cfg = hf.load(path)
    v = CLIP_V if family == "clip" else SIGLIP_V
    assert cfg.kind == "vit" and cfg.class_token == (family == "clip")
    pixels = np.random.default_rng(1).normal(size=(2, 3) + size).astype(np.float32)
    out = hf.hf_forward(module, pixel_values=pixels)
    for b in range(2):
        assert_close(out["last_hidden_state"][b], ref.vision_tower(t, family, v, pixels[b]))


def test_feature_layer_reads_penultimate_state(ckpts):
    path, t = ckpts["clip"]
    module, cfg = hf.load(path, feature_layer=-2)
    assert cfg.depth == 1 and len(module.layers) == 1 and module.final_ln is None
    pixels = np.random.default_rng(2).normal(size=(1, 3, 12, 12)).astype(np.float32)
    got = hf.hf_forward(module, pixel_values=pixels)["hidden_states[-2]"][0]
    assert_close(got, ref.vision_tower(t, "clip", CLIP_V, pixels[0], hidden_state=-2))


def test_vision_refusals():
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        hf.vision_config_from_hf(dict(CLIP_V, model_type="clip_vision_model", hidden_act="relu"))
    with pytest.raises(ValueError, match="image_size=13"):
        hf.vision_config_from_hf(dict(CLIP_V, model_type="clip_vision_model", image_size=13))
    with pytest.raises(UserError, match="feature_layer=-3"):
        hf.vision_config_from_hf(dict(CLIP_V, model_type="clip_vision_model"), feature_layer=-3)


# ---------------------------------------------------------------------------- Whisper


def test_whisper_encoder_matches_hf_reference(ckpts):
    path, t = ckpts["whisper"]
    module, cfg = hf.load(path)
    feats = np.random.default_rng(3).normal(size=(2, 6, 10)).astype(np.float32)
    got = hf.hf_forward(module, input_features=feats)["last_hidden_state"]
    for b in range(2):
        assert_close(got[b], ref.whisper_encoder(t, WHISPER, feats[b]))
    with pytest.raises(ValueError, match="takes exactly 10"):
        hf.hf_forward(module, input_features=feats[..., :8])


def test_whisper_sinusoid_is_whispers_formula():
    from mmjax.models.layers import whisper_sinusoids
    np.testing.assert_allclose(np.asarray(whisper_sinusoids(50, 16)),
                               ref.np_whisper_sinusoids(50, 16), atol=2e-5)


# ---------------------------------------------------------------------- export round trip


@pytest.mark.parametrize("name", ["v5", "qwen2", "clip", "siglip", "whisper"])
def test_load_export_load_is_bit_identical(ckpts, tmp_path, name):
    path, _ = ckpts[name]
    module, cfg = hf.load(path)
    export = {"clip": hf.export_vit_safetensors, "siglip": hf.export_vit_safetensors,
              "whisper": hf.export_whisper_encoder_safetensors}.get(name, hf.export_llm_safetensors)
    files = export(module, cfg, tmp_path / "out", max_shard_bytes=3000)
    assert len(files) > 1 and (tmp_path / "out" / hf.INDEX_NAME).exists()
    back, cfg2 = hf.load(tmp_path / "out")
    assert cfg2 == cfg
    a = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    b = nnx.to_pure_dict(nnx.state(back, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_packed_buffer_of_two_images_equals_each_image_alone(ckpts):
    """Training layout: two images of different grids share one buffer row (class tokens in
    the appended slots, positions interpolated per image) = HF's tower on each image."""
    path, t = ckpts["clip"]
    module, cfg = hf.load(path, max_images=2)
    rng = np.random.default_rng(4)
    imgs = [rng.normal(size=(3, 12, 12)), rng.normal(size=(3, 16, 8))]
    patches, seg, pos = [], [], []
    for k, img in enumerate(imgs):
        gh, gw = img.shape[1] // 4, img.shape[2] // 4
        x = img.transpose(1, 2, 0).reshape(gh, 4, gw, 4, 3).transpose(0, 2, 1, 3, 4)
        patches.append(x.reshape(gh * gw, 48))
        seg += [k + 1] * (gh * gw)
        pos += [divmod(i, gw) for i in range(gh * gw)]
    pad = 3
    patches = np.concatenate(patches + [np.zeros((pad, 48))])[None].astype(np.float32)
    seg = np.array(seg + [0] * pad)[None]
    pos = np.array(pos + [(0, 0)] * pad)[None]

    @nnx.jit
    def run(m, p, s, q):
        x = m.run_layers(m.embed(p, s, q), s)
        return m.finish(x), m.class_tokens(x)

    out, cls = run(module, patches, seg, pos)
    assert out.shape == (1, 20, 16) and cls.shape == (1, 2, 16)
    for k, (lo, hi) in enumerate([(0, 9), (9, 17)]):
        want = ref.vision_tower(t, "clip", CLIP_V, imgs[k])
        assert_close(out[0, lo:hi], want[1:])
        assert_close(cls[0, k], want[0])
