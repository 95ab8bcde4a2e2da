"""LoRA adapters in the planner's terms (no JAX): each adapted projection of a part adds
r (in + out) parameters and 2 r (in + out) FLOPs per token in the forward (models/lora.py).
A LoRA'd part trains only these: its base weights are frozen, its backward computes the
activation gradients (1 x forward, Cornstarch §4.2's frozen-with-trainable-upstream rule)
and the adapters' own, and only the adapters carry gradients and optimizer state."""
from __future__ import annotations

from mmjax.models.config import LLMConfig, MLLMConfig, VisionConfig
from mmjax.models.units import is_llm


def _llm_shapes(c: LLMConfig) -> dict:
    d, hd, f = c.hidden_size, c.dim_per_head, c.ffn_size
    hq, hkv = c.num_heads * hd, c.num_kv_heads * hd
    return {"q": (d, hq), "k": (d, hkv), "v": (d, hkv), "o": (hq, d), "gate": (d, f),
            "up": (d, f), "down": (f, d)}


def lora_layer_sizes(model: MLLMConfig, part: str) -> tuple[int, int]:
    """(r * sum(in + out) over one layer's adapted projections, layers) of `part` ("llm",
    an encoder's tower, "<enc>.projector"); (0, 0) without LoRA."""
    if is_llm(part):
        c = model.llm
        shapes, layers, lora = _llm_shapes(c), c.num_layers, c.lora
    elif part.endswith(".projector"):
        spec = model.encoder(part.removesuffix(".projector"))
        p, lora = spec.projector, spec.projector.lora
        din, d = spec.encoder.hidden_size * p.downsample, model.llm.hidden_size
        h = p.hidden_size or d
        shapes = {"fc1": (din, d)} if p.num_layers == 1 else {"fc1": (din, h), "fc2": (h, d)}
        layers = 1
    else:
        enc = model.encoder(part).encoder
        lora = getattr(enc, "lora", None)
        d, f = enc.hidden_size, enc.ffn_size
        shapes = {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc1": (d, f),
                  "fc2": (f, d)}
        layers = enc.depth if isinstance(enc, VisionConfig) else enc.num_layers
    if lora is None:
        return 0, 0
    kind = "llm" if is_llm(part) else "projector" if part.endswith(".projector") else "tower"
    width = sum(shapes[n][0] + shapes[n][1] for n in lora.targets_in(kind))
    return lora.rank * width, layers


def lora_params(model: MLLMConfig, part: str) -> int:
    """The adapter parameters of `part` (0 without LoRA)."""
    per_layer, layers = lora_layer_sizes(model, part)
    return per_layer * layers


def lora_flops(model: MLLMConfig, part: str, tokens: float) -> float:
    """Forward FLOPs of one layer's adapters of `part` over `tokens` tokens."""
    return 2.0 * tokens * lora_layer_sizes(model, part)[0]
