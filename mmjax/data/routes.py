"""Routes: which part goes where when a dp-blocked tensor moves between two units (no JAX).

Source rank i holds `src_slots` parts, destination rank j `dst_slots`; a `Routes` names, for
every destination (rank, slot), the source (rank, slot) that fills it, or nothing (zeros).
Order-preserving maps are DistTrain §7's broker between DP sizes a and b; general maps are
OrchMLLM §6's rearrangement composition applied in one transfer. The feed builds them
(`mmjax/data/feed.py`), the broker executes them (`mmjax/parallel/broker.py`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Routes:
    """Immutable, hashable part map. `sources[j * dst_slots + q]` is the `(rank, slot)` of
    the source part that fills destination rank j, slot q, or None (zero fill)."""

    src_ranks: int
    src_slots: int
    dst_ranks: int
    dst_slots: int
    sources: tuple[tuple[int, int] | None, ...]

    def __post_init__(self):
        for k in ("src_ranks", "src_slots", "dst_ranks", "dst_slots"):
            if getattr(self, k) < 1:
                raise ValueError(f"Routes.{k}={getattr(self, k)} must be >= 1")
        if len(self.sources) != self.dst_ranks * self.dst_slots:
            raise ValueError(f"Routes.sources has {len(self.sources)} entries; need dst_ranks *"
                             f" dst_slots = {self.dst_ranks * self.dst_slots}")
        for src in self.sources:
            if src is None:
                continue
            i, s = src
            if not (0 <= i < self.src_ranks and 0 <= s < self.src_slots):
                raise ValueError(f"Routes: source {src} out of range (src_ranks="
                                 f"{self.src_ranks}, src_slots={self.src_slots})")

    @property
    def pairs(self) -> tuple[tuple[int, int, int, int], ...]:
        """(src rank, src slot, dst rank, dst slot) for every filled destination slot."""
        return tuple((src[0], src[1], k // self.dst_slots, k % self.dst_slots)
                     for k, src in enumerate(self.sources) if src is not None)

    @property
    def is_identity(self) -> bool:
        return (self.src_ranks == self.dst_ranks and self.src_slots == self.dst_slots
                and all(src == divmod(k, self.dst_slots) for k, src in enumerate(self.sources)))

    @classmethod
    def from_pairs(cls, src_ranks: int, src_slots: int, dst_ranks: int, dst_slots: int,
                   pairs) -> "Routes":
        """General map (OrchMLLM §6 rearrangement composition): `pairs` of
        (src rank i, src slot s, dst rank j, dst slot q); unnamed destination slots get
        zeros. A destination slot may be named only once."""
        table: list = [None] * (dst_ranks * dst_slots)
        for i, s, j, q in pairs:
            if not (0 <= j < dst_ranks and 0 <= q < dst_slots):
                raise ValueError(f"Routes.from_pairs: destination ({j}, {q}) out of range "
                                 f"(dst_ranks={dst_ranks}, dst_slots={dst_slots})")
            k = j * dst_slots + q
            if table[k] is not None:
                raise ValueError(f"Routes.from_pairs: destination ({j}, {q}) is filled twice, "
                                 f"from {table[k]} and {(i, s)}; name each destination once")
            table[k] = (int(i), int(s))
        return cls(src_ranks, src_slots, dst_ranks, dst_slots, tuple(table))

    @classmethod
    def identity(cls, ranks: int) -> "Routes":
        """Every rank keeps its one part."""
        return cls(ranks, 1, ranks, 1, tuple((i, 0) for i in range(ranks)))

    @classmethod
    def order_preserving(cls, a: int, b: int, parts_total: int | None = None) -> "Routes":
        """DistTrain §7: dp a -> dp b keeping sample order. The `parts_total` parts (default
        lcm(a, b)) are numbered in global order; part p goes from source rank
        p // (parts_total / a) to destination rank p // (parts_total / b), so a > b
        concentrates, a < b scatters, and a, b with gcd g form g independent groups."""
        parts_total = math.lcm(a, b) if parts_total is None else parts_total
        if parts_total < 1 or parts_total % a or parts_total % b:
            raise ValueError(f"Routes.order_preserving: parts_total={parts_total} must be a "
                             f"positive multiple of lcm(a={a}, b={b}) = {math.lcm(a, b)}")
        ps, pr = parts_total // a, parts_total // b
        return cls(a, ps, b, pr, tuple(divmod(p, ps) for p in range(parts_total)))

    def inverse(self) -> "Routes":
        """The transposed map, for moving gradients back: destination (j, q) sends to the
        source (i, s) that filled it; source slots nobody read get zeros. Exact only when no
        source part fed two destinations, so that case is rejected."""
        table: list = [None] * (self.src_ranks * self.src_slots)
        for i, s, j, q in self.pairs:
            k = i * self.src_slots + s
            if table[k] is not None:
                raise ValueError(f"Routes.inverse: source part ({i}, {s}) feeds both "
                                 f"{table[k]} and {(j, q)}; its gradient would be a sum, "
                                 f"which a transfer cannot express: route each part once")
            table[k] = (j, q)
        return Routes(self.dst_ranks, self.dst_slots, self.src_ranks, self.src_slots,
                      tuple(table))

    def apply(self, parts: np.ndarray) -> np.ndarray:
        """Numpy reference: `[src_ranks * src_slots, ...]` -> `[dst_ranks * dst_slots, ...]`."""
        out = np.zeros((self.dst_ranks * self.dst_slots,) + parts.shape[1:], parts.dtype)
        for i, s, j, q in self.pairs:
            out[j * self.dst_slots + q] = parts[i * self.src_slots + s]
        return out
