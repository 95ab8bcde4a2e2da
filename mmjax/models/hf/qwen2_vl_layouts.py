"""The two config.json layouts and two tensor-name layouts of Qwen2-VL / Qwen2.5-VL
checkpoints, and the conversions between them that keep every field.

config.json, as each transformers writes it (tests/data/qwen2_vl/*_tf4, *_tf5):
  transformers 4 ("flat"): the text model's fields at the top level, `rope_theta` and
      `rope_scaling: {type: mrope, mrope_section}`, `torch_dtype`; vision_config.model_type
      "qwen2_vl" (Qwen2-VL) or "qwen2_5_vl_vision".
  transformers 5 ("nested"): `text_config` (model_type "<kind>_text", `rope_parameters:
      {rope_type: default, rope_theta, mrope_section}`), `dtype`; vision_config.model_type
      "<kind>_vision".
Tensor names: "legacy" (`visual.*`, `model.*`, `lm_head.weight`: transformers 4, and
transformers 5's save_pretrained) or "modules" (`model.visual.*`, `model.language_model.*`).
"""
from __future__ import annotations

import copy

# config.json fields of the whole model, not of its text model, in either layout
TOP_FIELDS = ("architectures", "model_type", "image_token_id", "video_token_id",
              "vision_start_token_id", "vision_end_token_id", "vision_token_id",
              "tie_word_embeddings", "transformers_version", "vision_config", "text_config",
              "dtype", "torch_dtype")


def _vision_type(kind: str, fmt: str) -> str:
    return kind if (kind == "qwen2_vl" and fmt == "flat") else kind + "_vision"


def convert_config(c: dict, fmt: str) -> dict:
    """config.json `c` (either layout) in layout `fmt` ("flat" or "nested"), every field
    kept where the other transformers reads it."""
    kind = c["model_type"]
    nested = "text_config" in c
    if fmt not in ("flat", "nested"):
        raise ValueError(f"config layout {fmt!r}: use 'flat' (transformers 4) or 'nested' "
                         f"(transformers 5)")
    if nested == (fmt == "nested"):
        return copy.deepcopy(c)
    out = {k: copy.deepcopy(v) for k, v in c.items() if k in TOP_FIELDS and k != "text_config"}
    vision = dict(out.get("vision_config") or {})
    if vision:
        vision["model_type"] = _vision_type(kind, fmt)
    if fmt == "nested":  # transformers 4 -> 5
        text = {k: copy.deepcopy(v) for k, v in c.items() if k not in TOP_FIELDS}
        scaling = text.pop("rope_scaling", None) or {}
        rope = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
        rope.update(rope_theta=text.pop("rope_theta", 1000000.0), rope_type="default")
        text.update(model_type=kind + "_text", rope_parameters=dict(sorted(rope.items())))
        if c.get("tie_word_embeddings"):  # where transformers 5 also puts a tied head
            text["tie_word_embeddings"] = True
        if "torch_dtype" in out:
            out["dtype"] = out.pop("torch_dtype")
        vision.setdefault("rope_parameters", {"rope_theta": 10000.0, "rope_type": "axial"})
        out["text_config"] = dict(sorted(text.items()))
    else:  # transformers 5 -> 4
        text = copy.deepcopy(c["text_config"])
        text.pop("model_type", None)
        text.pop("dtype", None)
        rope = dict(text.pop("rope_parameters", None) or {})
        theta = rope.pop("rope_theta", 1000000.0)
        rope.pop("rope_type", None)
        text.update(rope_theta=theta, rope_scaling={"type": "mrope", **rope})
        vision.pop("rope_parameters", None)
        if "dtype" in out:
            out["torch_dtype"] = out.pop("dtype")
        for k, v in text.items():
            out.setdefault(k, v)
    if vision:
        out["vision_config"] = dict(sorted(vision.items()))
    return out


def renamer(src: str, dst: str):
    """Tensor name in layout `src` -> in layout `dst` (None when they are the same)."""
    if src == dst:
        return None
    moves: tuple[tuple[str, str], ...] = (("visual.", "model.visual."),
                                          ("model.", "model.language_model."))
    if src == "modules":
        moves = tuple((b, a) for a, b in moves)

    def rename(name: str) -> str:
        for a, b in moves:
            if name.startswith(a):
                return b + name[len(a):]
        return name
    return rename
