"""Hugging Face Whisper encoder <-> `models.audio.AudioEncoder` (exactly HF's WhisperEncoder).

Whisper's `embed_positions.weight` (its fixed sinusoid table, never trained) loads into
`AudioEncoder.embed_positions`; a checkpoint without it gets the sinusoid HF initialises
(`layers.whisper_sinusoids`). Whisper's k_proj has no bias, nor has `AudioEncoder`'s.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmjax.models.config import AudioConfig
from mmjax.models.hf.checkpoint import (Checkpoint, Entry, LoadPlan, dense, layer_norm,
                                        module_pure, read_config, save_entries)
from mmjax.models.layer_range import layer_range
from mmjax.models.layers import whisper_sinusoids


def whisper_entries(cfg: AudioConfig, start: int = 0, end: int | None = None,
                    prefix: str = "") -> list[Entry]:
    """HF WhisperEncoder names for `AudioEncoder(cfg, key, start, end)`."""
    end = layer_range("audio layer", cfg.num_layers, start, end)[0]
    d, m, f = cfg.hidden_size, cfg.num_mel_bins, cfg.ffn_size
    out = []
    if start == 0:
        out += [Entry(prefix + "conv1.weight", ("conv1_kernel",), (3, m, d), True),
                Entry(prefix + "conv1.bias", ("conv1_bias",), (d,)),
                Entry(prefix + "conv2.weight", ("conv2_kernel",), (3, d, d), True),
                Entry(prefix + "conv2.bias", ("conv2_bias",), (d,)),
                Entry(prefix + "embed_positions.weight", ("embed_positions",),
                      (cfg.max_source_positions, d))]
    for i in range(start, end):
        p, j = f"{prefix}layers.{i}.", ("layers", i - start)
        out += (layer_norm(p + "self_attn_layer_norm", j + ("ln1",), d)
                + dense(p + "self_attn.q_proj", j + ("q",), d, d)
                + dense(p + "self_attn.k_proj", j + ("k",), d, d, bias=False)
                + dense(p + "self_attn.v_proj", j + ("v",), d, d)
                + dense(p + "self_attn.out_proj", j + ("o",), d, d)
                + layer_norm(p + "final_layer_norm", j + ("ln2",), d)
                + dense(p + "fc1", j + ("fc1",), d, f)
                + dense(p + "fc2", j + ("fc2",), f, d))
    if end == cfg.num_layers:
        out += layer_norm(prefix + "layer_norm", ("final_ln",), d)
    return out


def audio_config_from_hf(config) -> AudioConfig:
    """HF Whisper config.json (path, directory or dict) -> AudioConfig of its encoder."""
    c = read_config(config)
    if c.get("model_type") != "whisper":
        raise ValueError(f"config.json model_type={c.get('model_type')!r}: expected 'whisper'")
    act = c.get("activation_function", "gelu")
    if act != "gelu":
        raise ValueError(f"config.json activation_function={act!r}: mmjax's Whisper encoder "
                         f"uses exact 'gelu'")
    if c.get("scale_embedding"):
        raise ValueError("config.json scale_embedding=True: not modelled (Whisper uses False)")
    return AudioConfig(hidden_size=c["d_model"], num_layers=c["encoder_layers"],
                       num_heads=c["encoder_attention_heads"], ffn_size=c["encoder_ffn_dim"],
                       num_mel_bins=c["num_mel_bins"],
                       max_source_positions=c.get("max_source_positions", 1500))


def audio_config_to_hf(cfg: AudioConfig) -> dict:
    return {"architectures": ["WhisperEncoder"], "model_type": "whisper", "d_model": cfg.hidden_size,
            "encoder_layers": cfg.num_layers, "encoder_attention_heads": cfg.num_heads,
            "encoder_ffn_dim": cfg.ffn_size, "num_mel_bins": cfg.num_mel_bins,
            "max_source_positions": cfg.max_source_positions, "activation_function": "gelu",
            "scale_embedding": False}


def _whisper_prefix(ckpt: Checkpoint) -> str:
    """'' for a WhisperEncoder checkpoint, 'encoder.' / 'model.encoder.' for WhisperModel /
    WhisperForConditionalGeneration (whose decoder tensors are then left alone)."""
    for prefix in ("", "encoder.", "model.encoder."):
        if prefix + "conv1.weight" in ckpt.file:
            return prefix
    raise ValueError("audio: no 'conv1.weight' (nor 'encoder.conv1.weight', "
                     "'model.encoder.conv1.weight'): not a Whisper encoder checkpoint")


def whisper_load_plan(paths_or_dir, cfg: AudioConfig, start: int = 0,
                      end: int | None = None) -> LoadPlan:
    """What loading layers [start, end) reads; a checkpoint without `embed_positions.weight`
    keeps the module's init (the sinusoid HF initialises)."""
    ckpt = Checkpoint(paths_or_dir)
    prefix = _whisper_prefix(ckpt)
    table = prefix + "embed_positions.weight"
    entries = [e for e in whisper_entries(cfg, start, end, prefix)
               if e.hf != table or table in ckpt.file]
    known = {e.hf for e in whisper_entries(cfg, prefix=prefix)}
    return LoadPlan(ckpt, entries, known, "audio", prefix)


def load_whisper_encoder_safetensors(paths_or_dir, cfg: AudioConfig, start: int = 0,
                                     end: int | None = None, dtype=np.float32) -> dict:
    """HF Whisper encoder safetensors -> pure dict for `AudioEncoder(cfg, key, start, end)`."""
    plan = whisper_load_plan(paths_or_dir, cfg, start, end)
    pure = plan.read(dtype)
    if start == 0 and "embed_positions" not in pure:
        pure["embed_positions"] = np.asarray(
            whisper_sinusoids(cfg.max_source_positions, cfg.hidden_size), dtype)
    return pure


def export_whisper_encoder_safetensors(module_or_pure_dict, cfg: AudioConfig, path,
                                       max_shard_bytes: int | None = None,
                                       source=None) -> list[Path]:
    """A whole `AudioEncoder` -> HF Whisper safetensors (+ config.json). `source`: the
    Whisper checkpoint it was imported from (a WhisperModel / WhisperForConditionalGeneration
    or an encoder alone), written again with this encoder in place and the decoder copied
    untouched (write_back.py). Without one: the encoder alone, unprefixed, as transformers'
    `WhisperEncoder.from_pretrained` reads it (config architectures ["WhisperEncoder"])."""
    if source is None:
        files = save_entries(module_pure(module_or_pure_dict), whisper_entries(cfg), path,
                             "audio", max_shard_bytes)
        if Path(path).suffix != ".safetensors":
            (Path(path) / "config.json").write_text(json.dumps(audio_config_to_hf(cfg),
                                                               indent=2))
        return files
    from mmjax.models.hf.write_back import write_over_source

    plan = whisper_load_plan(source, cfg)
    plan.check()
    pure = module_pure(module_or_pure_dict)
    ours = {}
    for e in whisper_entries(cfg, prefix=plan.prefix):
        node = pure
        for k in e.path:
            node = node[k]
        ours[e.hf] = np.ascontiguousarray(e.to_hf(np.asarray(node)))
    if plan.prefix + "embed_positions.weight" not in plan.ckpt.file:  # HF's init: not stored
        ours.pop(plan.prefix + "embed_positions.weight")
    return write_over_source(ours, source, path, "audio", max_shard_bytes)
