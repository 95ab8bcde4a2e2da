"""A measured device profile for the cost model (DistTrain §3: "profile, then orchestrate").

The analytic model prices a layer at `peak x efficiency(width)`, an assumed curve
(`Hardware.efficiency`). A `HardwareProfile` replaces that curve with the efficiency this
device achieved: one generic transformer layer (`planner/profile.py profile_hardware`) timed
forward and backward at a grid of widths and sequence lengths, for the two layer kinds the
models have (SwiGLU + causal attention: the LLM; GELU MLP + full attention: encoders and the
generator). Efficiency at a point = the layer's model FLOPs (forward + 2x forward) / measured
time / peak; the planner reads it by bilinear interpolation in (log width, log tokens),
clamped at the grid's edges. No JAX here: the JSON was written on the device.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

from mmjax.errors import UserError

KINDS = ("gated_causal", "gelu_full")
# tokens one layer call runs together when planning with a profile (a microbatch of packed
# rows): a layer's matmuls are M x width x width, and M, not one sample, sets their speed
DEFAULT_CALL_TOKENS = 4096.0


def is_hardware_profile(path: str) -> bool:
    """Whether the JSON at `path` is a hardware profile (its measured "points"), not a
    model's C(TP, size) tables (planner/profile.py ProfileTable, "units")."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"--profile={path}: cannot read it as JSON ({e}); give a file "
                        f"written by scripts/profile_hardware.py or plan.py "
                        f"--write_profile") from None
    return isinstance(data, dict) and "points" in data


def layer_dims(kind: str, width: int) -> tuple[int, int]:
    """(ffn, heads) of the generic layer of `kind` at `width`: Llama's 3.5x SwiGLU with
    128-wide heads for the LLM kind, a 4x GELU MLP with 64-wide heads for encoders."""
    if kind == "gated_causal":
        return int(math.ceil(3.5 * width / 128) * 128), max(1, width // 128)
    if kind == "gelu_full":
        return 4 * width, max(1, width // 64)
    raise ValueError(f"layer kind {kind!r}: must be one of {list(KINDS)}")


def layer_flops(kind: str, width: int, tokens: int) -> float:
    """Forward model FLOPs of the generic layer on one sequence of `tokens` tokens: the four
    attention projections, the MLP, and the attention core (causal: the exact half)."""
    f, _ = layer_dims(kind, width)
    mlp = (3 if kind == "gated_causal" else 2) * width * f
    core = (2.0 if kind == "gated_causal" else 4.0) * tokens * tokens * width
    return 2.0 * tokens * (4 * width * width + mlp) + core


@dataclass(frozen=True)
class HardwareProfile:
    device: str
    peak_flops: float
    widths: tuple[int, ...]
    tokens: tuple[int, ...]
    efficiency_grid: dict  # kind -> [len(widths)][len(tokens)] achieved fraction of peak
    source: dict  # the measured JSON, kept for reports

    @property
    def attention(self) -> str:
        """The attention implementation the profiled layers ran ("cudnn" on a GPU)."""
        return str(self.source.get("attention", "?"))

    @classmethod
    def from_json(cls, d: dict, peak_flops: float) -> "HardwareProfile":
        pts = d.get("points")
        if not pts:
            raise UserError("hardware profile: no 'points' (write one with "
                            "scripts/profile_hardware.py on the device)")
        widths = tuple(sorted({p["width"] for p in pts}))
        tokens = tuple(sorted({p["tokens"] for p in pts}))
        grid = {}
        for kind in sorted({p["kind"] for p in pts}):
            g = np.full((len(widths), len(tokens)), np.nan)
            for p in pts:
                if p["kind"] == kind:
                    t = p["fwd_s"] + p["bwd_s"]
                    g[widths.index(p["width"]), tokens.index(p["tokens"])] = (
                        3 * layer_flops(kind, p["width"], p["tokens"]) / t / peak_flops)
            if np.isnan(g).any():
                raise UserError(f"hardware profile: kind {kind!r} does not cover the full "
                                f"width x tokens grid (re-run scripts/profile_hardware.py)")
            grid[kind] = g.tolist()
        return cls(d.get("device", "?"), peak_flops, widths, tokens, grid, d)

    @classmethod
    def load(cls, path: str, peak_flops: float) -> "HardwareProfile":
        with open(path) as f:
            return cls.from_json(json.load(f), peak_flops)

    def efficiency(self, kind: str, width: float, tokens: float) -> float:
        """Achieved fraction of peak of a `kind` layer `width` wide on sequences of
        `tokens` tokens: bilinear in (log width, log tokens), clamped to the grid."""
        g = np.asarray(self.efficiency_grid.get(kind) or next(iter(
            self.efficiency_grid.values())))
        wi, wf = _place(self.widths, width)
        ti, tf = _place(self.tokens, tokens)
        wj, tj = min(wi + 1, len(self.widths) - 1), min(ti + 1, len(self.tokens) - 1)
        top = g[wi, ti] * (1 - tf) + g[wi, tj] * tf
        bottom = g[wj, ti] * (1 - tf) + g[wj, tj] * tf
        return float(top * (1 - wf) + bottom * wf)


def _place(axis: tuple[int, ...], x: float) -> tuple[int, float]:
    """Index of the grid cell holding x and the fraction across it, in log space."""
    if x <= axis[0] or len(axis) == 1:
        return 0, 0.0
    if x >= axis[-1]:
        return len(axis) - 1, 0.0
    i = int(np.searchsorted(axis, x, side="right")) - 1
    lo, hi = math.log(axis[i]), math.log(axis[i + 1])
    return i, (math.log(x) - lo) / (hi - lo)
