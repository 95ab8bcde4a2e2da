"""Model configurations: plain frozen dataclasses, no JAX.

The planner (`mmjax/planner/`) reads these to count FLOPs and bytes, the Flax modules in
`mmjax/models/` read them to build parameters, and gin binds them. Keeping them JAX-free
lets the planner run in milliseconds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class LLMConfig:
    """Llama/Qwen2-style decoder (RMSNorm, RoPE, GQA, SwiGLU)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    head_dim: int | None = None  # default hidden_size // num_heads
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    norm_eps: float = 1e-6

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


@dataclass(frozen=True)
class VisionConfig:
    """ViT over packed variable-resolution patches (pre-LN, GELU MLP, biases)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    patch_size: int = 14
    num_channels: int = 3
    max_grid: int = 64  # max patches per side (factorised learned 2-D positions)
    norm_eps: float = 1e-6

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.num_channels


@dataclass(frozen=True)
class AudioConfig:
    """Whisper-style encoder: conv1d(k3) -> GELU -> conv1d(k3, stride 2) -> GELU ->
    sinusoidal positions -> pre-LN transformer -> final LayerNorm."""

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    num_mel_bins: int = 80
    norm_eps: float = 1e-5


@dataclass(frozen=True)
class ProjectorConfig:
    """Encoder -> LLM connector.

    kind="mlp": `num_layers` dense layers with GELU between (1 = a single linear layer, as
    Cornstarch uses; 2 = LLaVA-style MLP), after concatenating `downsample` consecutive
    encoder tokens (OrchMLLM §8 rates 1/2/4).
    kind="cross_attention": `num_queries` learned queries cross-attend to the encoder
    tokens, then an MLP maps to the LLM width (Perceiver-resampler style).
    """

    kind: Literal["mlp", "cross_attention"] = "mlp"
    num_layers: int = 2
    hidden_size: int | None = None  # default: LLM hidden size
    downsample: int = 1
    num_queries: int = 32
    num_heads: int = 8
    max_items: int = 1  # cross_attention: item slots per encoder buffer row (nq tokens each)


@dataclass(frozen=True)
class GeneratorConfig:
    """DiT-style diffusion denoiser over image latents, conditioned by cross-attention on the
    LLM hidden states at image-output positions (DistTrain's modality generator)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    latent_size: int = 64  # latent image side (image side / 8 for an SD-style VAE)
    latent_channels: int = 4
    patch_size: int = 2
    num_train_timesteps: int = 1000
    beta_start: float = 1e-4
    beta_end: float = 0.02
    norm_eps: float = 1e-6

    @property
    def num_patches(self) -> int:
        return (self.latent_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.latent_channels


EncoderKind = VisionConfig | AudioConfig


@dataclass(frozen=True)
class EncoderSpec:
    """One modality branch: encoder + projector, each with its own frozen flag."""

    name: str  # unit name, e.g. "vision", "audio"
    encoder: EncoderKind
    projector: ProjectorConfig = field(default_factory=ProjectorConfig)
    frozen: bool = False
    projector_frozen: bool = False

    @property
    def modality(self) -> str:
        return "image" if isinstance(self.encoder, VisionConfig) else "audio"


@dataclass(frozen=True)
class MLLMConfig:
    """A multimodal model: named encoder branches -> LLM -> optional generator.

    `placement`: "embed" scatters projected encoder tokens at placeholder positions of the
    text sequence; "prepend" puts them before the text (Cornstarch Fig. 11 a/b).
    """

    name: str
    llm: LLMConfig
    encoders: tuple[EncoderSpec, ...] = ()
    generator: GeneratorConfig | None = None
    llm_frozen: bool = False
    generator_frozen: bool = False
    placement: Literal["embed", "prepend"] = "embed"

    def encoder(self, name: str) -> EncoderSpec:
        for spec in self.encoders:
            if spec.name == name:
                return spec
        raise KeyError(f"no encoder named {name!r}; have {[e.name for e in self.encoders]}")

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Units in execution-DAG order: encoders (independent), llm, generator."""
        names = tuple(e.name for e in self.encoders) + ("llm",)
        return names + (("generator",) if self.generator is not None else ())

    def frozen(self, unit: str) -> bool:
        if unit == "llm":
            return self.llm_frozen
        if unit == "generator":
            return self.generator_frozen
        return self.encoder(unit).frozen

    def num_layers(self, unit: str) -> int:
        if unit == "llm":
            return self.llm.num_layers
        if unit == "generator":
            assert self.generator is not None
            return self.generator.num_layers
        return self.encoder(unit).encoder.num_layers

    def replace(self, **kw) -> "MLLMConfig":
        return dataclasses.replace(self, **kw)


def with_overrides(cfg, overrides: dict | None):
    """Apply dotted-path overrides, e.g. {"llm.num_layers": 2, "encoders.vision.frozen": True}.

    Raises ValueError naming the bad path, so a typo in a gin binding fails before any work.
    """
    for path, value in (overrides or {}).items():
        cfg = _set_path(cfg, path.split("."), value, path)
    return cfg


def _set_path(obj, parts, value, full):
    head, rest = parts[0], parts[1:]
    if isinstance(obj, tuple):  # encoders: select by name
        for i, item in enumerate(obj):
            if getattr(item, "name", None) == head:
                new = _set_path(item, rest, value, full) if rest else value
                return obj[:i] + (new,) + obj[i + 1:]
        raise ValueError(f"override {full!r}: no element named {head!r}")
    if not dataclasses.is_dataclass(obj) or head not in {f.name for f in dataclasses.fields(obj)}:
        names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) else []
        raise ValueError(f"override {full!r}: {type(obj).__name__} has no field {head!r}; fields: {names}")
    new = _set_path(getattr(obj, head), rest, value, full) if rest else value
    return dataclasses.replace(obj, **{head: new})
