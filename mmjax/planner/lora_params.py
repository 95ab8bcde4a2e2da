"""LoRA adapters in the planner's terms (no JAX): each adapted projection of a part adds
r (in + out) parameters and 2 r (in + out) FLOPs per token in the forward (models/lora.py).
A LoRA'd part trains only these: its base weights are frozen, its backward computes the
activation gradients (1 x forward, Cornstarch §4.2's frozen-with-trainable-upstream rule)
and the adapters' own, and only the adapters carry gradients and optimizer state."""
from __future__ import annotations

from mmjax.models.config import LLMConfig, MLLMConfig, VisionConfig
from mmjax.models.lora_config import tower_kind
from mmjax.models.units import is_llm


def _llm_shapes(c: LLMConfig) -> dict:
    d, hd, f = c.hidden_size, c.dim_per_head, c.ffn_size
    hq, hkv = c.num_heads * hd, c.num_kv_heads * hd
    return {"q": (d, hq), "k": (d, hkv), "v": (d, hkv), "o": (hq, d), "gate": (d, f),
            "up": (d, f), "down": (f, d)}


def _tower_shapes(enc) -> dict:
    """A tower's projections {name: (in, out)}: a Qwen2-VL tower's fused qkv and proj, its
    fc1 / fc2 or (Qwen2.5-VL) gate / up / down; else q, k, v, o, fc1, fc2."""
    d, f = enc.hidden_size, enc.ffn_size
    if tower_kind(enc) == "qwen2_vl":
        mlp = ({"gate": (d, f), "up": (d, f), "down": (f, d)} if enc.gated_mlp
               else {"fc1": (d, f), "fc2": (f, d)})
        return {"qkv": (d, 3 * d), "proj": (d, d), **mlp}
    return {"q": (d, d), "k": (d, d), "v": (d, d), "o": (d, d), "fc1": (d, f), "fc2": (f, d)}


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
        lora, shapes = getattr(enc, "lora", None), _tower_shapes(enc)
        layers = enc.depth if isinstance(enc, VisionConfig) else enc.num_layers
    if lora is None:
        return 0, 0
    kind = ("llm" if is_llm(part) else "projector" if part.endswith(".projector")
            else tower_kind(model.encoder(part).encoder))
    width = sum(shapes[n][0] + shapes[n][1] for n in lora.targets_in(kind) if n in shapes)
    return lora.rank * width, layers


def lora_params(model: MLLMConfig, part: str) -> int:
    """The adapter parameters of `part` (0 without LoRA)."""
    per_layer, layers = lora_layer_sizes(model, part)
    return per_layer * layers


def lora_flops(model: MLLMConfig, part: str, tokens: float) -> float:
    """Forward FLOPs of one layer's adapters of `part` over `tokens` tokens."""
    return 2.0 * tokens * lora_layer_sizes(model, part)[0]
