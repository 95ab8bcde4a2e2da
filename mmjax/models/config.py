"""Model configurations: plain frozen dataclasses, no JAX.

The planner (`mmjax/planner/`) reads these to count FLOPs and bytes, the Flax modules in
`mmjax/models/` read them to build parameters, and gin binds them. Keeping them JAX-free
lets the planner run in milliseconds. Overrides by dotted path: models/overrides.py; to and
from JSON: models/config_json.py.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from mmjax.errors import UserError
from mmjax.models.lora_config import LoRAConfig
from mmjax.models.overrides import with_overrides  # noqa: F401 (its 30-odd importers)
from mmjax.models.qwen2_vl_config import check_mrope, check_qwen2_vl_vision
from mmjax.models.units import LLM_UNIT, UnitDag, UnitRole, role


ROPE_SCALINGS = ("linear", "llama3", "yarn")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
VisionAct = Literal["gelu_tanh", "quick_gelu", "gelu", "silu"]  # VisionConfig.act
ProjectorAct = Literal["gelu_tanh", "gelu"]  # ProjectorConfig.act


@dataclass(frozen=True)
class LLMConfig:
    """Llama/Qwen2-style decoder (RMSNorm, RoPE, GQA, SwiGLU) and the options of the other
    decoder families mmjax imports (Qwen3, Gemma 2 / 3, Phi-3, Mistral's sliding window).

    `rope_scaling`: None, ("linear", factor), ("llama3", factor, low_freq_factor,
    high_freq_factor, original_max_positions) or ("yarn", factor, original_max_positions,
    beta_fast, beta_slow, attention_factor, truncate) (`layers.rope_inv_freq`).
    `sliding_window`: keys with idx_q - idx_k < window only, on the layers `sliding_layers`
    marks (None: every layer); `rope_local_theta`: the sliding layers' own unscaled RoPE
    base (Gemma 3's local layers). Gemma: `gemma_norms` ((1 + w) RMSNorm scales),
    `sandwich_norms` (norms on the attention and MLP outputs too), `embed_scale`
    (embeddings * sqrt(hidden_size)), `attn_scale` (query_pre_attn_scalar ** -0.5),
    `attn_softcap` / `final_softcap` (tanh soft-capping), `mlp_act="gelu_tanh"` (GeGLU).
    """

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
    rope_scaling: tuple | None = None  # see the class docstring; None: plain RoPE
    # Qwen2-VL M-RoPE: frequency sections (t, h, w) over head_dim / 2 (HF `mrope_section`);
    # positions are then [B, S, 3] (`layers.rope`). None: plain 1-D RoPE.
    mrope_section: tuple[int, ...] | None = None
    # one lax.scan over the stacked layers (compile time flat in depth; models/scan.py)
    scan_layers: bool = False
    # per-layer recomputation inside the stack (models/scan.py): "none", "dots" (keep the
    # weight matmuls' outputs) or "full" (keep each layer's input only)
    remat: str = "none"
    # > 0: the LM head and cross-entropy run fused over chunks of this many tokens
    # (models/chunked_loss.py), never holding [tokens, vocab] float32 logits; 0: plain
    loss_chunk: int = 0
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k before RoPE
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    mlp_act: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None
    rope_local_theta: float | None = None
    # the Hugging Face model_type to export as, where the options do not imply it (Phi-3's
    # fused tensors; a Mistral without a window); None: inferred (hf/llm_config.py)
    hf_type: str | None = None
    # low-rank adapters on the decoder's projections (models/lora.py); None: none
    lora: LoRAConfig | None = None

    def __post_init__(self):
        check_mrope(self.mrope_section, self.dim_per_head)
        if self.mlp_act not in MLP_ACTIVATIONS:
            raise UserError(f"LLMConfig.mlp_act={self.mlp_act!r}: use one of {MLP_ACTIVATIONS}")
        if self.rope_scaling is not None and (not isinstance(self.rope_scaling, tuple)
                                              or self.rope_scaling[0] not in ROPE_SCALINGS):
            raise UserError(f"LLMConfig.rope_scaling={self.rope_scaling!r}: use None or a tuple "
                            f"starting with one of {ROPE_SCALINGS}")
        if self.loss_chunk < 0:
            raise UserError(f"LLMConfig.loss_chunk={self.loss_chunk}: use 0 (plain head and "
                            f"loss) or a positive number of tokens per chunk")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UserError(f"LLMConfig.sliding_window={self.sliding_window}: use None or >= 1")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_layers:
            raise UserError(f"LLMConfig.sliding_layers has {len(self.sliding_layers)} entries "
                            f"for {self.num_layers} layers: give one bool per layer")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def is_sliding(self, layer: int) -> bool:
        """Does layer `layer` attend through the sliding window (and its local RoPE)?"""
        if self.sliding_window is None:
            return False
        return True if self.sliding_layers is None else bool(self.sliding_layers[layer])

    @property
    def layers_differ(self) -> bool:
        """Do layers differ in window or RoPE (a layer scan then carries a per-layer flag)?"""
        flags = {self.is_sliding(i) for i in range(self.num_layers)}
        return len(flags) > 1


@dataclass(frozen=True)
class VisionConfig:
    """A vision tower over packed patch buffers (pre-LN blocks with biases).

    kind="packed": NaViT-style ViT (factorised learned 2-D positions, final LayerNorm).
    kind="vit": standard ViT as CLIP / SigLIP (`models/vit.py`): learned 1-D position table
    over the native `image_size / patch_size` grid, bicubically resampled to other grids;
    `class_token` (CLIP), `pre_norm` (CLIP's pre_layrnorm), `post_norm` (SigLIP's
    post_layernorm), `patch_bias` (SigLIP's patch conv has a bias, CLIP's none).
    `act`: "gelu_tanh" (packed, SigLIP), "quick_gelu" (OpenAI CLIP), "gelu" (exact).
    `feature_layer`: None -> the projector reads the tower's output (HF last_hidden_state);
    k < 0 -> HF hidden_states[k] (LLaVA: -2), so only `depth` layers are built and run.
    `max_images`: with a class token, images per packed buffer row (one class slot each).
    kind="qwen2_vl": Qwen2-VL / Qwen2.5-VL's native-resolution ViT (`models/qwen2_vl_vision.py`):
    patches of `temporal_patch_size` frames (patch_dim C*T*p*p in HF's (c, t, py, px) order),
    2-D RoPE over (row, col), no learned positions, no final norm (the `patch_merger`
    projector's ln_q is it); `norm` "layer" + `act` quick_gelu (Qwen2-VL) or "rms" + gated
    `act` silu MLP (Qwen2.5-VL, `gated_mlp`); `window_size` > 0: window attention over
    window_size/patch_size patches per side except in `fullatt_block_indexes` (Qwen2.5-VL).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    patch_size: int = 14
    num_channels: int = 3
    max_grid: int = 64  # max patches per side (packed: factorised learned 2-D positions)
    norm_eps: float = 1e-6
    kind: Literal["packed", "vit", "qwen2_vl"] = "packed"
    image_size: int = 224
    class_token: bool = False
    pre_norm: bool = False
    post_norm: bool = True
    patch_bias: bool = True
    act: VisionAct = "gelu_tanh"
    feature_layer: int | None = None
    max_images: int = 1
    # one lax.scan over the stacked layers (compile time flat in depth; models/scan.py)
    scan_layers: bool = False
    # per-layer recomputation inside the stack (models/scan.py): "none", "dots" (keep the
    # weight matmuls' outputs) or "full" (keep each layer's input only)
    remat: str = "none"
    # kind="qwen2_vl" only (see the docstring)
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    norm: Literal["layer", "rms"] = "layer"
    gated_mlp: bool = False
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    # low-rank adapters on the tower's blocks (models/lora.py)
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.kind not in ("packed", "vit", "qwen2_vl"):
            raise UserError(f"VisionConfig.kind={self.kind!r}: use 'packed', 'vit' or 'qwen2_vl'")
        if self.act not in ("gelu_tanh", "quick_gelu", "gelu", "silu"):
            raise UserError(f"VisionConfig.act={self.act!r}: use gelu_tanh, quick_gelu, gelu "
                             f"or silu")
        if self.kind != "qwen2_vl" and (self.temporal_patch_size != 1 or self.spatial_merge_size
                                        != 1 or self.norm != "layer" or self.gated_mlp
                                        or self.window_size or self.fullatt_block_indexes):
            raise UserError("VisionConfig: temporal_patch_size / spatial_merge_size / norm / "
                             "gated_mlp / window_size / fullatt_block_indexes are options of "
                             "kind='qwen2_vl'; set kind='qwen2_vl'")
        if self.kind == "qwen2_vl":
            check_qwen2_vl_vision(self)
        if self.feature_layer is not None and not -self.num_layers <= self.feature_layer < 0:
            raise UserError(f"VisionConfig.feature_layer={self.feature_layer}: use None or "
                             f"-{self.num_layers}..-1 (HF hidden_states index; LLaVA: -2)")
        if self.kind == "packed" and (self.class_token or self.pre_norm or not self.post_norm
                                      or not self.patch_bias or self.feature_layer is not None
                                      or self.act != "gelu_tanh"):
            raise UserError("VisionConfig: class_token / pre_norm / post_norm / patch_bias / "
                             "act / feature_layer are options of kind='vit'; set kind='vit'")

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.num_channels * self.temporal_patch_size

    @property
    def depth(self) -> int:
        """Layers built and run: all, or up to the hidden state `feature_layer` names."""
        return self.num_layers if self.feature_layer is None else self.num_layers + 1 + self.feature_layer

    @property
    def final_norm(self) -> bool:
        return self.post_norm and self.feature_layer is None

    @property
    def native_grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_positions(self) -> int:
        return self.native_grid ** 2 + int(self.class_token)


@dataclass(frozen=True)
class AudioConfig:
    """Whisper encoder (HF WhisperEncoder): conv1d(k3) -> GELU -> conv1d(k3, stride 2) ->
    GELU -> + Whisper's sinusoid table -> pre-LN transformer (exact GELU) -> LayerNorm.
    `max_source_positions`: Whisper's window in tokens (1500, i.e. 3000 frames = 30 s)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_size: int
    num_mel_bins: int = 80
    norm_eps: float = 1e-5
    max_source_positions: int = 1500
    # one lax.scan over the stacked layers (compile time flat in depth; models/scan.py)
    scan_layers: bool = False
    # per-layer recomputation inside the stack (models/scan.py): "none", "dots" (keep the
    # weight matmuls' outputs) or "full" (keep each layer's input only)
    remat: str = "none"


@dataclass(frozen=True)
class ProjectorConfig:
    """Encoder -> LLM connector.

    kind="mlp": `num_layers` dense layers with GELU between (1 = a single linear layer, as
    Cornstarch uses; 2 = LLaVA-style MLP), after concatenating `downsample` consecutive
    encoder tokens (OrchMLLM §8 rates 1/2/4).
    kind="cross_attention": `num_queries` learned queries cross-attend to the encoder
    tokens, then an MLP maps to the LLM width (Perceiver-resampler style).
    kind="patch_merger": Qwen2-VL's PatchMerger (`models/qwen2_vl_vision.py`): the tower's
    norm (ln_q) on each token, `downsample` (= spatial_merge_size^2) consecutive tokens
    concatenated, Linear -> exact GELU -> Linear to the LLM width.
    """

    kind: Literal["mlp", "cross_attention", "patch_merger"] = "mlp"
    num_layers: int = 2
    hidden_size: int | None = None  # default: LLM hidden size
    downsample: int = 1
    num_queries: int = 32
    num_heads: int = 8
    max_items: int = 1  # cross_attention: item slots per encoder buffer row (nq tokens each)
    # the MLP's activation: "gelu_tanh" (mmjax's default) or "gelu" (exact, as HF LLaVA's
    # projector_hidden_act="gelu" names it)
    act: ProjectorAct = "gelu_tanh"
    # low-rank adapters on the MLP's layers (kind "mlp"; models/lora.py); None: none
    lora: LoRAConfig | None = None

    def __post_init__(self):
        if self.lora is not None and self.kind != "mlp":
            raise UserError(f"lora on a {self.kind!r} projector: LoRA adapts kind='mlp' "
                            f"projectors only; leave the projector out of lora.units")


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
    # one lax.scan over the stacked layers (compile time flat in depth; models/scan.py)
    scan_layers: bool = False
    # per-layer recomputation inside the stack (models/scan.py): "none", "dots" (keep the
    # weight matmuls' outputs) or "full" (keep each layer's input only)
    remat: str = "none"

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
class VAEConfig:
    """diffusers' AutoencoderKL config (config.json names). SD 2.1: the defaults. The
    module is models/vae.py; here so that configs and the planner read it without JAX."""

    in_channels: int = 3
    out_channels: int = 3
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    latent_channels: int = 4
    norm_num_groups: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float = 0.0
    sample_size: int = 768
    mid_block_add_attention: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        for c in self.block_out_channels:
            if c % self.norm_num_groups:
                raise ValueError(f"VAE block_out_channels {self.block_out_channels}: {c} is not "
                                 f"divisible by norm_num_groups={self.norm_num_groups}")

    @property
    def downsample(self) -> int:
        """Image side / latent side (8 for SD's four blocks)."""
        return 2 ** (len(self.block_out_channels) - 1)


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
    # the generator's frozen VAE as a unit of the model (its image encoder placed on
    # devices: target pixels in the batch, latents computed in the step); None: the data
    # path encodes the targets (host CPU or producers) and the batch carries latents
    vae: VAEConfig | None = None
    placement: Literal["embed", "prepend"] = "embed"
    # HF LLaVA semantics (hf/llava.py sets both): "causal" puts image tokens under the LLM's
    # causal mask like text; "bidirectional" (mmjax's default, Cornstarch §4.3.1) lets an
    # image's tokens see each other. `modality_markers`: wrap each modality block in its
    # begin / end tokens (LLaVA has none). `image_markers`: the (begin, end) token ids of
    # image blocks when the checkpoint has its own (Qwen2-VL's vision_start / vision_end, set
    # by hf/qwen2_vl.py); None: the tokenizer's (or the reserved) markers.
    image_attention: Literal["bidirectional", "causal"] = "bidirectional"
    modality_markers: bool = True
    image_markers: tuple[int, int] | None = None

    def __post_init__(self):
        for unit in self.lora_units():
            base = unit.removesuffix(".projector")
            frozen = (self.encoder(base).projector_frozen if unit.endswith(".projector")
                      else self.frozen(unit))
            if frozen:
                raise UserError(f"lora.units has {unit!r}, which is also set frozen: a LoRA'd "
                                f"part's base is frozen and its adapters train; unset one of the two")

    def lora_units(self) -> tuple[str, ...]:
        """The parts with LoRA adapters: "llm", an encoder's tower ("vision") or its
        projector ("vision.projector")."""
        out = [LLM_UNIT] if self.llm.lora is not None else []
        for e in self.encoders:
            if getattr(e.encoder, "lora", None) is not None:
                out.append(e.name)
            if e.projector.lora is not None:
                out.append(e.name + ".projector")
        return tuple(out)

    def encoder(self, name: str) -> EncoderSpec:
        for spec in self.encoders:
            if spec.name == name:
                return spec
        raise KeyError(f"no encoder named {name!r}; have {[e.name for e in self.encoders]}")

    def vision_tower(self, name: str = "vision") -> VisionConfig:
        """The tower of encoder `name`, which must be a vision tower."""
        tower = self.encoder(name).encoder
        if not isinstance(tower, VisionConfig):
            raise ValueError(f"encoder {name!r} is a {type(tower).__name__}, not a vision "
                             f"tower (VisionConfig)")
        return tower

    @property
    def units(self) -> UnitDag:
        """The unit execution DAG (models/units.py): encoders -> llm -> generator."""
        return UnitDag.from_config(self)

    @property
    def unit_names(self) -> tuple[str, ...]:
        """Units in execution-DAG order: encoders (independent), llm, generator."""
        return self.units.names

    def frozen(self, unit: str) -> bool:
        match role(unit):
            case UnitRole.LLM:
                return self.llm_frozen
            case UnitRole.GENERATOR:
                return self.generator_frozen
            case UnitRole.VAE:
                return True
        return self.encoder(unit).frozen

    def num_layers(self, unit: str) -> int:
        match role(unit):
            case UnitRole.LLM:
                return self.llm.num_layers
            case UnitRole.GENERATOR:
                assert self.generator is not None
                return self.generator.num_layers
            case UnitRole.VAE:  # one indivisible stage (pp = 1)
                return 1
        enc = self.encoder(unit).encoder
        return enc.depth if isinstance(enc, VisionConfig) else enc.num_layers

    def replace(self, **kw) -> "MLLMConfig":
        return dataclasses.replace(self, **kw)
