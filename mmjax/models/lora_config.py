"""LoRA settings of a unit (no JAX): which projections carry low-rank adapters, their rank
and scale (Hu et al., LoRA §4.1; rsLoRA: Kalajdzievski, "A Rank Stabilization Scaling
Factor for Fine-Tuning with LoRA" §3). The modules read `LoRAConfig.targets_in(kind)`;
docs/lora.md tells the story."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mmjax.errors import UserError

# The projections each kind of unit offers, by mmjax's names (HF's in docs/lora.md).
PROJECTIONS = {
    "llm": ("q", "k", "v", "o", "gate", "up", "down"),
    "tower": ("q", "k", "v", "o", "fc1", "fc2"),
    # a Qwen2-VL tower: fused qkv, proj; fc1 / fc2 (Qwen2-VL) or gate / up / down (2.5-VL)
    "qwen2_vl": ("qkv", "proj", "fc1", "fc2", "gate", "up", "down"),
    "projector": ("fc1", "fc2"),
}
GROUPS = {"attention": ("q", "k", "v", "o", "qkv", "proj"),
          "mlp": ("gate", "up", "down", "fc1", "fc2")}


def tower_kind(encoder) -> str:
    """The `PROJECTIONS` kind of an encoder's tower: "qwen2_vl" or "tower"."""
    return "qwen2_vl" if getattr(encoder, "kind", None) == "qwen2_vl" else "tower"


@dataclass(frozen=True)
class LoRAConfig:
    """`rank` r, `alpha`: the update is B A x * alpha / r (alpha / sqrt(r) with `rslora`);
    `targets`: projection names of `PROJECTIONS` or the groups "attention", "mlp", "all";
    `dropout`: the probability peft's `lora_dropout` carries (applied to the adapter's
    input while training)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q", "k", "v", "o")
    dropout: float = 0.0
    rslora: bool = False

    def __post_init__(self):
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise UserError(f"lora.rank={self.rank!r}: must be an int >= 1 (e.g. 8)")
        if not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise UserError(f"lora.alpha={self.alpha!r}: must be a number > 0 (e.g. 16)")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout={self.dropout!r}: must be in [0, 1)")
        known = set(GROUPS) | {"all"} | {p for ps in PROJECTIONS.values() for p in ps}
        bad = [t for t in self.targets if t not in known]
        if not self.targets or bad:
            raise UserError(f"lora.targets={list(self.targets)!r}: use names of "
                            f"{sorted(known)} (e.g. ['q', 'v'] or ['attention', 'mlp'])")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def targets_in(self, kind: str) -> tuple[str, ...]:
        """The projections of a unit of `kind` (a `PROJECTIONS` key) it adapts, in
        `PROJECTIONS` order."""
        wanted = set()
        for t in self.targets:
            wanted |= set(PROJECTIONS[kind]) if t == "all" else set(GROUPS.get(t, (t,)))
        return tuple(p for p in PROJECTIONS[kind] if p in wanted)


def lora_from_dict(d: dict | None) -> LoRAConfig | None:
    """Inverse of `dataclasses.asdict` (a workdir's saved config)."""
    if d is None:
        return None
    return LoRAConfig(**{**d, "targets": tuple(d["targets"])})
