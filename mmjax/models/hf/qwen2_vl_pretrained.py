"""Whole Qwen2-VL / Qwen2.5-VL checkpoints as pretrained units of a training run
(`pretrained.llm` / `pretrained.vision` naming the same directory): what each pipeline stage
of the LLM or the tower reads, and the merger's MLP for the `patch_merger` projector on the
tower's last stage (`hf/pretrained.py`, `pipeline/runtime.py`)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from mmjax.models.config import LLMConfig
from mmjax.models.hf.checkpoint import Checkpoint, Entry, LoadPlan, read_config
from mmjax.models.hf.llm import check_tied_head, llm_entries
from mmjax.models.hf.qwen2_vl import (_names_of, model_type_of, qwen2_vl_config_from_hf,
                                      qwen2_vl_entries)
from mmjax.models.units import is_llm


def is_qwen2_vl_dir(path) -> bool:
    """Is `path` a whole Qwen2-VL / Qwen2.5-VL checkpoint directory (with config.json)?"""
    if isinstance(path, (list, tuple)) or not (Path(path) / "config.json").is_file():
        return False
    return model_type_of(read_config(path)) is not None


def _relative(entries: list[Entry], root: tuple, start: int = 0) -> list[Entry]:
    """Entries under `root`, their paths relative to it and layer indices from `start`."""
    out = []
    for e in entries:
        if e.path[:len(root)] != root:
            continue
        path = e.path[len(root):]
        if path[:1] == ("layers",):
            path = ("layers", path[1] - start) + path[2:]
        out.append(dataclasses.replace(e, path=path))
    return out


def qwen2_vl_unit_plan(path, unit_cfg, start: int = 0, end: int | None = None) -> LoadPlan:
    """What one pipeline stage of the LLM (`unit_cfg` an LLMConfig) or of the tower (a
    qwen2_vl VisionConfig) reads from a whole checkpoint: layers [start, end) renumbered
    from 0, the embedding / head or patch embedding / ln_q where the stage holds them;
    paths relative to the unit's module (as `pretrained.load_stage_state` roots them)."""
    full = qwen2_vl_config_from_hf(path)
    ckpt = Checkpoint(path)
    names = _names_of(ckpt)
    entries = qwen2_vl_entries(full, names)
    if isinstance(unit_cfg, LLMConfig):
        end = unit_cfg.num_layers if end is None else end
        want = {e.hf for e in llm_entries(unit_cfg, start, end)}
        if names == "modules":
            want = {"model.language_model." + n[len("model."):] if n.startswith("model.")
                    else n for n in want}
        rel = [e for e in _relative(entries, ("llm",), start) if e.hf in want]
        prefix = "model." if names == "legacy" else "model.language_model."
        known = {e.hf for e in entries if is_llm(e.path[0])} | {"lm_head.weight"}
        return LoadPlan(ckpt, rel, known, "Qwen2-VL LLM", prefix)
    end = unit_cfg.num_layers if end is None else end
    rel = [e for e in _relative(entries, ("encoders", "vision"), start)
           if (e.path[0] == "layers" and 0 <= e.path[1] < end - start)
           or (e.path[0] == "patch_embed" and start == 0)
           or (e.path[0] == "final_ln" and end == unit_cfg.num_layers)]
    prefix = "visual." if names == "legacy" else "model.visual."
    known = {e.hf for e in entries if not is_llm(e.path[0])}
    return LoadPlan(ckpt, rel, known, "Qwen2-VL tower", prefix)


def qwen2_vl_projector_plan(path) -> LoadPlan:
    """The merger's MLP (the `patch_merger` projector), paths relative to the projector."""
    full = qwen2_vl_config_from_hf(path)
    ckpt = Checkpoint(path)
    names = _names_of(ckpt)
    entries = qwen2_vl_entries(full, names)
    rel = _relative(entries, ("projectors", "vision"))
    prefix = ("visual." if names == "legacy" else "model.visual.") + "merger.mlp."
    return LoadPlan(ckpt, rel, {e.hf for e in rel}, "Qwen2-VL merger", prefix)


def qwen2_vl_check_tied(path, llm: LLMConfig) -> None:
    """A tied checkpoint's `lm_head.weight`, if any, must equal the embedding."""
    ckpt = Checkpoint(path)
    embed = ("model.embed_tokens.weight" if _names_of(ckpt) == "legacy"
             else "model.language_model.embed_tokens.weight")
    check_tied_head(ckpt, llm, ckpt.read(embed) if "lm_head.weight" in ckpt.file else None)
