"""`MultimodalModel`: named encoder branches -> LLM -> optional diffusion generator.

The execution DAG is the config's `UnitDag` (models/units.py, read through `dag()`): every
encoder branch (encoder + projector) is independent, all feed the LLM, the LLM feeds the
generator (Cornstarch §3 modular MLLM; DistTrain's encoder -> backbone -> generator).
Frozen flags live in the config, per module and per projector; `trainable_filter` selects
what gets gradients and optimizer state.

The per-unit functions below (`encode`, `llm_embed`, `llm_meta`, `lm_outputs`,
`generator_inputs`) are what both the single-device reference and the pipeline stages call,
so both run the same arithmetic, in the same compute dtype: floating encoder inputs
(patches, log-mel frames) are cast to it like the LLM embeddings and the generator's noisy
latents, so with bf16 compute the encoders and projectors run bf16 matmuls as the pipeline
stages do (`pipeline/stage.py` `apply_encoder`). `MultimodalModel.__call__` runs the units
in a topological order of `dag()`, each reading its predecessors' outputs. Batch arrays
follow `mmjax/data/assemble.py`.
"""
from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import filterlib

from mmjax.models.attention import IMPLEMENTATIONS, TokenMeta, allowed_mask
from mmjax.models.audio import AudioEncoder
from mmjax.models.config import AudioConfig, EncoderSpec, MLLMConfig, VisionConfig
from mmjax.models.generator import DiffusionGenerator, add_noise, diffusion_loss_sum
from mmjax.models.layers import cast_floats
from mmjax.models.llm import LLM, merge_modalities, meta_attend
from mmjax.models.lora import LoRAParam
from mmjax.models.projector import make_projector
from mmjax.models.qwen2_vl_vision import Qwen2VLVision
from mmjax.models.units import (GENERATOR_UNIT, LLM_UNIT, VAE_UNIT, UnitRole, is_llm, role,
                                topological_order)
from mmjax.models.vae import AutoencoderKL, patchified_latents
from mmjax.models.scan import unit_scope
from mmjax.models.vision import VisionEncoder
from mmjax.models.vit import StandardViT


def unit_key(root, name: str):
    """Stable per-unit PRNG key (independent of how many units exist or their order)."""
    return jax.random.fold_in(root, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def make_encoder(spec: EncoderSpec, key, start=0, end=None):
    if isinstance(spec.encoder, VisionConfig):
        kind = {"vit": StandardViT, "qwen2_vl": Qwen2VLVision}.get(spec.encoder.kind,
                                                                   VisionEncoder)
        return kind(spec.encoder, key, start, end)
    if isinstance(spec.encoder, AudioConfig):
        return AudioEncoder(spec.encoder, key, start, end)
    raise TypeError(f"encoder {spec.name!r}: unsupported config {type(spec.encoder).__name__}")


def encoder_segments(spec: EncoderSpec, inputs, num_tokens: int):
    """Per encoder-token item ids [N, T] (for cross-attention projectors)."""
    if isinstance(spec.encoder, VisionConfig):
        return inputs["patch_seg"]
    return (jnp.arange(num_tokens)[None, :] < (inputs["frame_len"][:, None] + 1) // 2).astype(jnp.int32)


def encoder_embed(spec: EncoderSpec, encoder, inputs):
    if isinstance(spec.encoder, VisionConfig):
        if spec.encoder.kind == "vit":
            return encoder.embed(inputs["patches"], inputs["patch_seg"], inputs["patch_pos"])
        if spec.encoder.kind == "qwen2_vl":
            return encoder.embed(inputs["patches"])
        return encoder.embed(inputs["patches"], inputs["patch_pos"])
    return encoder.embed(inputs["mels"], inputs["frame_len"])


def encoder_layers(spec: EncoderSpec, encoder, x, inputs, attention_impl: str = "auto"):
    if isinstance(spec.encoder, VisionConfig):
        if spec.encoder.kind == "qwen2_vl":  # 2-D RoPE and windows read the positions
            return encoder.run_layers(x, inputs["patch_seg"], inputs["patch_pos"], attention_impl)
        return encoder.run_layers(x, inputs["patch_seg"], attention_impl)
    return encoder.run_layers(x, inputs["frame_len"], attention_impl)


def project(spec: EncoderSpec, projector, x, inputs, attention_impl: str = "auto"):
    """Encoder output [N, T, e] -> flattened LLM-width tokens [N * T', D]."""
    y = projector(x, encoder_segments(spec, inputs, x.shape[1]), attention_impl)
    return y.reshape(-1, y.shape[-1])


def encode(spec: EncoderSpec, encoder, projector, inputs, dtype=jnp.float32,
           attention_impl: str = "auto"):
    """One encoder branch (encoder + projector) in `dtype` -> [N * T', D] LLM-width tokens."""
    inputs = cast_floats(inputs, dtype)  # sets the encoder's dtype (Dense casts weights)
    x = encoder_embed(spec, encoder, inputs)
    y = encoder.finish(encoder_layers(spec, encoder, x, inputs, attention_impl))
    return project(spec, projector, y, inputs, attention_impl)


def llm_embed(cfg: MLLMConfig, llm: LLM, batch, enc_outputs: dict, dtype=jnp.float32):
    x = llm.embed_tokens(batch["tokens"], dtype)
    gathers = {e.name: batch[f"gather_{e.name}"] for e in cfg.encoders}
    return merge_modalities(x, enc_outputs, gathers)


def llm_meta(batch) -> TokenMeta:
    """The LLM tokens' bitfield-mask metadata (Cornstarch §4.3.1), int32 [B, S] each."""
    idx = jnp.broadcast_to(jnp.arange(batch["tokens"].shape[-1], dtype=jnp.int32),
                           batch["tokens"].shape)
    return TokenMeta(batch["bam"].astype(jnp.int32), batch["doc"].astype(jnp.int32),
                     batch["sub"].astype(jnp.int32), idx)


def unit_attention(attention_impl, unit: str) -> str:
    """The attention implementation of `unit`: one name for all units, or a {unit: name}
    dict (missing units: "auto"), as a Plan gives per unit."""
    impl = attention_impl.get(unit, "auto") if isinstance(attention_impl, dict) else attention_impl
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"error: attention_impl for unit {unit!r} is {impl!r} "
                         f"(use one of {list(IMPLEMENTATIONS)})")
    return impl


def llm_allowed(batch):
    """The dense [B, S, S] mask of `llm_meta` (tests and the dense reference)."""
    idx = jnp.broadcast_to(jnp.arange(batch["tokens"].shape[-1]), batch["tokens"].shape)
    bam = batch["bam"].astype(jnp.int32)
    return allowed_mask(bam, bam, idx, idx, batch["doc"], batch["doc"], batch["sub"], batch["sub"])


def lm_outputs(llm: LLM, h, batch, with_generator: bool):
    """Last LLM stage: (sum of text CE, final hidden states at generator query positions)."""
    hf = llm.final_hidden(h)
    lm_sum = llm.loss_sum(hf, batch["targets"], batch["loss_mask"])
    if not with_generator:
        return lm_sum, None
    flat = hf.reshape(-1, hf.shape[-1])
    return lm_sum, flat[batch["gen_query"]]


def vae_outputs(cfg: MLLMConfig, vae: AutoencoderKL, batch):
    """The VAE unit: the batch's target pixels `gen_pixels` -> patchified latents [G, P, pd]
    (float32, whatever the compute dtype: the VAE is frozen and runs as diffusers does)."""
    assert cfg.generator is not None  # a VAE unit comes with a generator (UnitDag.of)
    return patchified_latents(vae, batch["gen_pixels"], cfg.generator.patch_size)


def generator_inputs(cfg: MLLMConfig, batch, dtype=jnp.float32, latents=None):
    """(noisy latents in `dtype`, timesteps): `latents` the VAE unit's output, or None for
    the batch's own `gen_latents` (encoded in the data path)."""
    assert cfg.generator is not None  # called for the generator unit only
    latents = batch["gen_latents"] if latents is None else latents
    noisy = add_noise(cfg.generator, latents, batch["gen_noise"], batch["gen_t"])
    return noisy.astype(dtype), batch["gen_t"]


def normalise(lm_sum, diff_sum, batch):
    """Divide by the GLOBAL counts, so any split or reorder of the batch changes nothing."""
    n_tok = jnp.maximum(jnp.asarray(batch["num_target_tokens"], jnp.float32), 1.0)
    n_gen = jnp.maximum(jnp.asarray(batch.get("num_gen_elements", 1), jnp.float32), 1.0)
    return lm_sum / n_tok, diff_sum / n_gen


class MultimodalModel(nnx.Module):
    def __init__(self, cfg: MLLMConfig, key):
        self.cfg = cfg
        d = cfg.llm.hidden_size
        self.encoders = nnx.Dict({e.name: make_encoder(e, unit_key(key, e.name))
                                  for e in cfg.encoders})
        self.projectors = nnx.Dict({
            e.name: make_projector(e.projector, e.encoder.hidden_size, d,
                                   unit_key(key, e.name + "/projector"))
            for e in cfg.encoders})
        self.llm = LLM(cfg.llm, unit_key(key, LLM_UNIT))
        self.generator = (DiffusionGenerator(cfg.generator, d, unit_key(key, GENERATOR_UNIT))
                          if cfg.generator is not None else None)
        # frozen: its weights come from the diffusers checkpoint (`vae.path`), never trained
        self.vae = (AutoencoderKL(cfg.vae, unit_key(key, VAE_UNIT))
                    if cfg.vae is not None else None)

    def dag(self) -> list[tuple[str, str]]:
        """Execution-DAG edges (src, dst) of the config's `UnitDag`: every encoder branch
        -> llm -> generator."""
        return list(self.cfg.units.edges)

    def execution_order(self) -> list[str]:
        """The units in a topological order of `dag()` (ties keep the config's order).
        Raises ValueError on an edge naming an unknown unit or a cycle."""
        return topological_order(self.cfg.unit_names, self.dag())

    def __call__(self, batch, dtype=jnp.float32, attention_impl="auto",
                 llm_mask_family: str = "bam", route=None):
        """-> (loss, {"lm_loss", "diffusion_loss"}) on a batch with global normalisers.

        `attention_impl`: one `bam_attention` implementation for every unit, or a dict
        {unit: implementation} (the per-unit choice a Plan makes); `llm_mask_family`: the
        LLM's mask family (`AssemblyLayout.llm_mask_family`); `route`: a function
        ({encoder: outputs}, batch) -> {encoder: outputs} between the encoders and the LLM (the
        co-located runner's move from the encoder phase's layout to the LLM's; None: as is).

        Walks `dag()` in topological order: an encoder branch reads its batch inputs, the
        LLM merges the outputs of its encoder predecessors at their placeholder positions and
        returns the text-loss sum (and the generator's conditioning states), the generator
        reads the LLM's states (and the VAE unit's latents when the model has one, else the
        batch's)."""
        cfg, edges = self.cfg, self.dag()
        out: dict[str, Any] = {}  # each unit's outputs
        lm_sum, diff_sum = None, jnp.zeros((), jnp.float32)
        for unit in self.execution_order():
            with unit_scope(unit):  # a trace-time tag only (models/scan.py)
                preds = [src for src, dst in edges if dst == unit]
                kind = role(unit)
                if kind is UnitRole.LLM:
                    missing = [e.name for e in cfg.encoders if e.name not in preds]
                    if missing:
                        raise ValueError(f"dag() has no edge from encoder(s) {missing} to 'llm', "
                                         f"but the batch places their tokens in the LLM sequence")
                    enc = {p: out[p] for p in preds}
                    x = llm_embed(cfg, self.llm, batch, enc if route is None else route(enc, batch),
                                  dtype)
                    attend = meta_attend(llm_meta(batch), unit_attention(attention_impl, unit),
                                         llm_mask_family)
                    h = self.llm.run_layers(x, batch["positions"], attend)
                    lm_sum, out[unit] = lm_outputs(self.llm, h, batch, self.generator is not None)
                elif kind is UnitRole.GENERATOR:
                    assert self.generator is not None  # the unit exists iff cfg.generator does
                    kinds = [role(p) for p in preds]
                    n_vae = kinds.count(UnitRole.VAE)
                    if kinds.count(UnitRole.LLM) != 1 or len(preds) != 1 + n_vae:
                        raise ValueError(f"generator must be conditioned on exactly the LLM (and "
                                         f"read the VAE unit's latents); dag() gives predecessors "
                                         f"{preds}")
                    latents = next((out[p] for p in preds if role(p) is UnitRole.VAE), None)
                    noisy, t = generator_inputs(cfg, batch, dtype, latents)
                    eps = self.generator(noisy, t, out[preds[kinds.index(UnitRole.LLM)]],
                                         unit_attention(attention_impl, unit))
                    diff_sum = diffusion_loss_sum(eps, batch["gen_noise"], batch["gen_valid"])
                elif kind is UnitRole.VAE:
                    assert self.vae is not None  # the unit exists iff cfg.vae does
                    out[unit] = vae_outputs(cfg, self.vae, batch)
                else:
                    if preds:
                        raise ValueError(f"encoder {unit!r} takes only batch inputs; dag() gives "
                                         f"it predecessors {preds}")
                    out[unit] = encode(cfg.encoder(unit), self.encoders[unit],
                                       self.projectors[unit], batch["encoders"][unit], dtype,
                                       unit_attention(attention_impl, unit))
        lm, diff = normalise(lm_sum, diff_sum, batch)
        return lm + diff, {"lm_loss": lm, "diffusion_loss": diff}


def trainable_filter(cfg: MLLMConfig):
    """nnx filter for parameters that train (frozen modules get no grads, no opt state; a
    LoRA'd part trains its adapters only).
    Whisper's position table (`embed_positions`) is fixed, as in Whisper, so never trains."""
    frozen: list[filterlib.Filter] = [nnx.PathContains("embed_positions")] if any(
        isinstance(e.encoder, AudioConfig) for e in cfg.encoders) else []
    for e in cfg.encoders:
        if e.frozen:
            frozen.append(nnx.All(nnx.PathContains("encoders"), nnx.PathContains(e.name)))
        if e.projector_frozen:
            frozen.append(nnx.All(nnx.PathContains("projectors"), nnx.PathContains(e.name)))
    if cfg.llm_frozen:
        frozen.append(nnx.PathContains(LLM_UNIT))
    if cfg.generator_frozen:
        frozen.append(nnx.PathContains(GENERATOR_UNIT))
    if cfg.vae is not None:  # always frozen: no gradients, no optimizer state, not saved
        frozen.append(nnx.PathContains(VAE_UNIT))
    frozen += lora_bases(cfg)
    if not frozen:
        return nnx.Param
    base = nnx.All(nnx.Param, nnx.Not(nnx.Any(*frozen)))
    return nnx.Any(LoRAParam, base) if cfg.lora_units() else base


def lora_bases(cfg: MLLMConfig) -> list[filterlib.Filter]:
    """Filters of the LoRA'd parts' base weights: frozen, only their adapters train
    (models/lora.py)."""
    out: list[filterlib.Filter] = []
    for unit in cfg.lora_units():
        if is_llm(unit):
            out.append(nnx.PathContains(LLM_UNIT))
        elif unit.endswith(".projector"):
            out.append(nnx.All(nnx.PathContains("projectors"),
                               nnx.PathContains(unit.removesuffix(".projector"))))
        else:
            out.append(nnx.All(nnx.PathContains("encoders"), nnx.PathContains(unit)))
    return out
