"""Per-stage parameter trees -> one tree laid out like the single-device model (layers
renumbered globally), for the parity tests (the package's own logical layout is
train/logical_state.py)."""
from __future__ import annotations

from flax import nnx

from mmjax.models.units import is_encoder
from mmjax.planner.plan import Plan


def _offset_layers(tree: dict, start: int) -> dict:
    out = dict(tree)
    if "layers" in out:
        out["layers"] = {int(k) + start: v for k, v in out["layers"].items()}
    return out


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def to_reference_layout(plan: Plan, trees: dict) -> dict:
    """Per-stage pure dicts (StageId -> nnx pure dict) -> one pure dict laid out like
    `MultimodalModel` (layers renumbered globally), for parity checks and checkpoints."""
    out: dict = {}
    for sid, tree in trees.items():
        u = plan.unit(sid.unit)
        start, _ = u.stage_layers(sid.index % u.pp, sid.index // u.pp)
        if not is_encoder(sid.unit):  # the stage's tree is the unit's own module
            part = {sid.unit: _offset_layers(tree, start)}
        else:
            part = {}
            if "encoders" in tree:
                part["encoders"] = {sid.unit: _offset_layers(tree["encoders"][sid.unit], start)}
            if "projectors" in tree:
                part["projectors"] = tree["projectors"]
        out = _deep_merge(out, part)
    return out


def pure_grads(res) -> dict:
    """A pipeline step's summed `grads` as pure dicts per stage (what
    `to_reference_layout` takes)."""
    return {sid: nnx.to_pure_dict(g) for sid, g in res.grads.items()}
