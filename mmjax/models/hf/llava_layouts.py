"""LLaVA checkpoints in transformers 4's and 5's layouts, and the conversions between them
(`hf.save(..., layout=)`, `export_hf.py --layout`), every config field kept where the other
transformers reads it.

Tensor names (what each `save_pretrained` writes; hf/llava.py reads all three):
  "tf4":   vision_tower.vision_model.*, multi_modal_projector.*, language_model.model.*,
           language_model.lm_head.weight (transformers 4.57 writes these legacy names)
  "tf452": model.vision_tower.vision_model.*, model.multi_modal_projector.*,
           model.language_model.*, lm_head.weight (checkpoints of transformers 4.52 - 4.56)
  "tf5":   as tf4 with the tower unprefixed: vision_tower.* (no vision_model.)
config.json: transformers 4 puts the text model's RoPE in `rope_theta` + `rope_scaling`
(Gemma 3: `rope_local_base_freq` for sliding layers) and names the dtype `torch_dtype`;
transformers 5 in `rope_parameters` (by layer type for Gemma 3) and `dtype`.
"""
from __future__ import annotations

import copy

LAYOUTS = ("tf4", "tf5")
_PREFIX = {"tf4": {"tower": "vision_tower.vision_model.", "projector": "multi_modal_projector.",
                   "llm": "language_model.model.", "head": "language_model.lm_head.weight"},
           "tf452": {"tower": "model.vision_tower.vision_model.",
                     "projector": "model.multi_modal_projector.",
                     "llm": "model.language_model.", "head": "lm_head.weight"},
           "tf5": {"tower": "vision_tower.", "projector": "multi_modal_projector.",
                   "llm": "language_model.model.", "head": "language_model.lm_head.weight"}}


def names_layout(names) -> str:
    """Which tensor-name layout a LLaVA checkpoint's names are in."""
    names = list(names)
    if any(n.startswith("model.vision_tower.") for n in names):
        return "tf452"
    return "tf4" if any(n.startswith("vision_tower.vision_model.") for n in names) else "tf5"


def renamer(src: str, dst: str):
    """Tensor name in layout `src` -> in layout `dst` (None when they are the same)."""
    if src == dst:
        return None
    a, b = _PREFIX[src], _PREFIX[dst]

    def rename(name: str) -> str:
        for part in ("head", "tower", "projector", "llm"):  # head first: exact name
            if part == "head" and name == a["head"]:
                return b["head"]
            if part != "head" and name.startswith(a[part]):
                return b[part] + name[len(a[part]):]
        raise ValueError(f"llava: tensor {name!r} is in no part of the {src} layout")
    return rename


def _text_to_tf4(t: dict) -> dict:
    rope = t.pop("rope_parameters", None)
    if rope is not None:
        if "full_attention" in rope or "sliding_attention" in rope:  # Gemma 3
            local = (rope.get("sliding_attention") or {}).get("rope_theta")
            if local is not None:
                t["rope_local_base_freq"] = local
            rope = dict(rope.get("full_attention") or {})
        rope = dict(rope)
        if "rope_theta" in rope:
            t["rope_theta"] = rope.pop("rope_theta")
        partial = rope.pop("partial_rotary_factor", 1.0)
        if partial != 1.0:
            t["partial_rotary_factor"] = partial
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            t["rope_scaling"] = rope
    return t


def _text_to_tf5(t: dict) -> dict:
    scaling = dict(t.pop("rope_scaling", None) or {})
    if "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    rope = dict(scaling or {"rope_type": "default"})
    if "rope_theta" in t:
        rope["rope_theta"] = t.pop("rope_theta")
    if t.get("model_type") == "phi3":
        rope["partial_rotary_factor"] = t.pop("partial_rotary_factor", 1.0)
    if t.get("model_type") == "gemma3_text":
        local = {"rope_type": "default"}
        if "rope_local_base_freq" in t:
            local["rope_theta"] = t.pop("rope_local_base_freq")
        rope = {"sliding_attention": local, "full_attention": rope}
    t["rope_parameters"] = rope
    return t


def _dtype_key(c: dict, dst: str) -> None:
    old, new = ("dtype", "torch_dtype") if dst == "tf4" else ("torch_dtype", "dtype")
    if old in c:
        c[new] = c.pop(old)


def convert_llava_config(c: dict, dst: str) -> dict:
    """A LLaVA config.json (either layout) as transformers `dst` ("tf4", "tf5") writes it."""
    if dst not in LAYOUTS:
        raise ValueError(f"layout={dst!r}: use one of {', '.join(LAYOUTS)}")
    out = copy.deepcopy(c)
    text = out.get("text_config")
    if text is not None:
        is_tf5 = "rope_parameters" in text
        if is_tf5 and dst == "tf4":
            out["text_config"] = _text_to_tf4(text)
        elif not is_tf5 and dst == "tf5":
            out["text_config"] = _text_to_tf5(text)
    for d in (out, out.get("text_config") or {}, out.get("vision_config") or {}):
        _dtype_key(d, dst)
    return out
