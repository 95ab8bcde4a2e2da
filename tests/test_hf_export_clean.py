"""Exports transformers loads with no missing or unexpected keys (checked once against
transformers 5.24, see notes/README_export.md): a Whisper encoder imported from a whole
Whisper is written back as that Whisper, decoder copied untouched; one without a source as
transformers' WhisperEncoder (unprefixed, architectures ["WhisperEncoder"]); a CLIP tower
always carries `post_layernorm` (the source's, or HF's LayerNorm init)."""
import json

import jax
import numpy as np
from safetensors.numpy import load_file

import hf_reference as ref
from test_pretrained_training import CLIP
from mmjax.models import hf
from mmjax.models.audio import AudioEncoder
from mmjax.models.vit import StandardViT

WHISPER = {"model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
           "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 2,
           "encoder_ffn_dim": 48, "num_mel_bins": 8, "max_source_positions": 16,
           "decoder_layers": 1, "vocab_size": 100}


def test_whisper_written_back_whole_and_alone(tmp_path):
    t = ref.whisper_tensors(WHISPER, seed=4)
    rng = np.random.default_rng(5)
    t.update({"model.decoder.embed_tokens.weight": ref.rand(rng, 100, 32),
              "model.decoder.layer_norm.weight": ref.rand(rng, 32)})  # a decoder, untouched
    src = ref.write_checkpoint(tmp_path / "whisper", WHISPER, t)
    module, cfg = hf.load(src)
    hf.save(module, cfg, tmp_path / "back")
    got = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(got) == sorted(t) and all(got[k].tobytes() == t[k].tobytes() for k in t)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == WHISPER
    fresh = AudioEncoder(cfg, jax.random.key(1))
    hf.save(fresh, cfg, tmp_path / "alone")  # made in mmjax: no source
    alone = load_file(str(tmp_path / "alone" / "model.safetensors"))
    assert sorted(alone) == sorted(k[len("model.encoder."):] for k in t
                                   if k.startswith("model.encoder."))
    conf = json.loads((tmp_path / "alone" / "config.json").read_text())
    assert conf["architectures"] == ["WhisperEncoder"] and conf["model_type"] == "whisper"
    again, _ = hf.load(tmp_path / "alone")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 hf.checkpoint.module_pure(again), hf.checkpoint.module_pure(fresh))


def test_clip_export_carries_post_layernorm(tmp_path):
    t = ref.tower_tensors("clip", CLIP, seed=6)
    src = ref.write_checkpoint(tmp_path / "clip", CLIP, t)
    module, cfg = hf.load(src)
    hf.save(module, cfg, tmp_path / "back")  # over the source: its post_layernorm
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted(t)
    assert back["vision_model.post_layernorm.weight"].tobytes() == \
        t["vision_model.post_layernorm.weight"].tobytes()
    hf.export_vit_safetensors(StandardViT(cfg, jax.random.key(1)), cfg, tmp_path / "alone")
    alone = load_file(str(tmp_path / "alone" / "model.safetensors"))
    assert sorted(alone) == sorted(t)  # every CLIPVisionModel tensor
    np.testing.assert_array_equal(alone["vision_model.post_layernorm.weight"], np.ones(32))
    np.testing.assert_array_equal(alone["vision_model.post_layernorm.bias"], np.zeros(32))


def test_tower_from_clipmodel_written_back_as_clipmodel(tmp_path):
    t = ref.tower_tensors("clip", CLIP, seed=7)
    rng = np.random.default_rng(8)
    text = {"text_model.embeddings.token_embedding.weight": ref.rand(rng, 50, 16),
            "text_projection.weight": ref.rand(rng, 8, 16),
            "visual_projection.weight": ref.rand(rng, 8, 32), "logit_scale": np.ones((), np.float32)}
    conf = {"model_type": "clip", "architectures": ["CLIPModel"], "vision_config": CLIP}
    src = ref.write_checkpoint(tmp_path / "clipmodel", conf, {**t, **text})
    module, cfg = hf.load(src)
    module = StandardViT(cfg, jax.random.key(3))  # as after training: other tower weights
    hf.save(module, cfg, tmp_path / "back", source=src)
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sorted(back) == sorted({**t, **text})
    assert all(back[k].tobytes() == v.tobytes() for k, v in text.items())  # untouched
    assert back["vision_model.pre_layrnorm.weight"].tobytes() != t["vision_model.pre_layrnorm.weight"].tobytes()
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == ["CLIPModel"]
