"""Parameter counts of every module (no JAX), following the Flax modules' layout exactly
(`num_params`), and the share Megatron tensor parallelism leaves whole on every rank
(`replicated_params`): what the cost model's weight, optimizer and gradient bytes count.
"""
from __future__ import annotations

from mmjax.models.config import (AudioConfig, GeneratorConfig, LLMConfig, MLLMConfig,
                                 ProjectorConfig, VisionConfig)
from mmjax.models.units import is_generator, is_llm, is_vae
from mmjax.planner.lora_params import lora_params
from mmjax.planner.vae_placement import vae_params


def _encoder_layer_params(d: int, f: int) -> int:
    return 2 * d + 4 * (d * d + d) + 2 * d + d * f + f + f * d + d


def llm_params(c: LLMConfig) -> int:
    d, hd, h, kv, f, v = (c.hidden_size, c.dim_per_head, c.num_heads, c.num_kv_heads,
                          c.ffn_size, c.vocab_size)
    b = 1 if c.qkv_bias else 0
    layer = (d + d * h * hd + b * h * hd + 2 * (d * kv * hd + b * kv * hd) + h * hd * d
             + d + 3 * d * f)
    return v * d + c.num_layers * layer + d + (0 if c.tie_embeddings else d * v)


def vision_params(c: VisionConfig) -> int:
    d = c.hidden_size
    layers = c.depth * _encoder_layer_params(d, c.ffn_size)
    if c.kind == "packed":
        return c.patch_dim * d + d + 2 * c.max_grid * d + layers + 2 * d
    if c.kind == "qwen2_vl":  # no positions; norms with(out) bias; gated MLP (Qwen2.5-VL)
        f, nb = c.ffn_size, 2 if c.norm == "layer" else 1
        mlp = 3 * d * f + 2 * f + d if c.gated_mlp else 2 * d * f + f + d
        layer = 2 * nb * d + 3 * d * d + 3 * d + d * d + d + mlp
        return c.patch_dim * d + c.depth * layer + nb * d
    return (c.patch_dim * d + d * c.patch_bias + c.num_positions * d + d * c.class_token
            + 2 * d * c.pre_norm + layers + 2 * d * c.final_norm)


def audio_params(c: AudioConfig) -> int:
    d = c.hidden_size
    return (c.num_mel_bins * 3 * d + d + d * 3 * d + d + c.max_source_positions * d
            + c.num_layers * (_encoder_layer_params(d, c.ffn_size) - d) + 2 * d)  # no k bias


def mlp_dims(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> list[int]:
    """Widths of an "mlp" or "patch_merger" projector (the merger's hidden: r * enc_dim)."""
    h = p.hidden_size or (enc_dim * p.downsample if p.kind == "patch_merger" else llm_dim)
    return [enc_dim * p.downsample] + [h] * (p.num_layers - 1) + [llm_dim]


def projector_params(p: ProjectorConfig, enc_dim: int, llm_dim: int) -> int:
    if p.kind in ("mlp", "patch_merger"):
        dims = mlp_dims(p, enc_dim, llm_dim)
        return sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
    e, h = enc_dim, p.hidden_size or llm_dim
    return p.num_queries * e + 4 * e + 4 * (e * e + e) + e * h + h + h * llm_dim + llm_dim


def _dit_block_params(g: GeneratorConfig) -> int:
    d, f = g.hidden_size, g.ffn_size
    return (d * 6 * d + 6 * d) + 4 * (d * d + d) + 2 * d + 4 * (d * d + d) + d * f + f + f * d + d


def generator_params(g: GeneratorConfig, cond_dim: int) -> int:
    d, pd = g.hidden_size, g.patch_dim
    block = _dit_block_params(g)
    return (pd * d + d + 256 * d + d + d * d + d + cond_dim * d + d + g.num_layers * block
            + d * 2 * d + 2 * d + d * pd + pd)


def layer_params(model: MLLMConfig, unit: str, unit_params: float, layers: int) -> float:
    """Parameters of one layer of `unit` (of `unit_params` in `layers` layers): the weights
    a ZeRO-3 layer scan gathers at once. The LLM's and the DiT's blocks exactly (the LLM
    without its embeddings, head and final norm); an encoder's as its parameters / layers
    (patch embedding, positions and projector spread over them: an upper bound)."""
    if is_llm(unit):
        c = model.llm
        outside = c.vocab_size * c.hidden_size * (1 if c.tie_embeddings else 2) + c.hidden_size
        return (llm_params(c) - outside) / max(c.num_layers, 1)
    if is_generator(unit):
        assert model.generator is not None  # the model has a generator unit
        return float(_dit_block_params(model.generator))
    return unit_params / max(layers, 1)


def module_params(model: MLLMConfig) -> dict[str, int]:
    """Parameters per module: '<enc>', '<enc>.projector', 'llm', 'generator' (LoRA
    adapters included: planner/lora_params.py)."""
    out = {}
    for e in model.encoders:
        enc = e.encoder
        out[e.name] = vision_params(enc) if isinstance(enc, VisionConfig) else audio_params(enc)
        out[f"{e.name}.projector"] = projector_params(e.projector, enc.hidden_size,
                                                      model.llm.hidden_size)
        out[e.name] += lora_params(model, e.name) if isinstance(enc, VisionConfig) else 0
        out[f"{e.name}.projector"] += lora_params(model, f"{e.name}.projector")
    out["llm"] = llm_params(model.llm) + lora_params(model, "llm")
    if model.generator is not None:
        out["generator"] = generator_params(model.generator, model.llm.hidden_size)
    return out


def num_params(config, cond_dim: int | None = None) -> int:
    """Parameter count of a model or module config (exactly the Flax layout)."""
    if isinstance(config, MLLMConfig):
        return sum(module_params(config).values())
    if isinstance(config, LLMConfig):
        return llm_params(config)
    if isinstance(config, VisionConfig):
        return vision_params(config)
    if isinstance(config, AudioConfig):
        return audio_params(config)
    if isinstance(config, GeneratorConfig):
        if cond_dim is None:
            raise ValueError("num_params(GeneratorConfig) needs cond_dim= (the LLM hidden size)")
        return generator_params(config, cond_dim)
    raise TypeError(f"num_params: unsupported config type {type(config).__name__}")


def replicated_params(model: MLLMConfig, unit: str) -> int:
    """Parameters of `unit` that Megatron TP leaves whole on every rank (parallel/tensor.py
    `megatron_role`): all but the blocks' q/k/v/o/fc1/fc2 (and cross-attention) matrices
    with their column biases, the LLM's projections and its vocabulary matrices."""
    params = module_params(model)
    if is_vae(unit):  # never split: tp = 1
        v = model.vae
        assert v is not None  # the model has a VAE unit
        return vae_params(v.block_out_channels, v.layers_per_block, v.in_channels,
                          v.latent_channels, v.out_channels, v.mid_block_add_attention,
                          v.use_quant_conv, v.use_post_quant_conv)
    if is_llm(unit):
        llm = model.llm
        return llm.num_layers * 2 * llm.hidden_size + llm.hidden_size
    if is_generator(unit):
        g = model.generator
        assert g is not None  # the model has a generator unit
        d, f = g.hidden_size, g.ffn_size
        return params[unit] - g.num_layers * (8 * d * d + 6 * d + 2 * d * f + f)
    c = model.encoder(unit).encoder
    d, f = c.hidden_size, c.ffn_size
    biases = 2 if isinstance(c, AudioConfig) else 3  # Whisper's key has no bias
    layers = c.depth if isinstance(c, VisionConfig) else c.num_layers
    return (params[unit] + params[f"{unit}.projector"]
            - layers * (4 * d * d + biases * d + 2 * d * f + f))
