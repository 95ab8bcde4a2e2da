"""Rearrangements (OrchMLLM §5.1) and their composition (§6): where every example moves."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class Rearrangement:
    """Where each example moves: ``samples[k]`` goes from ``src[k]`` to ``dst[k]``.

    Positions are (rank, slot): slot = index in that rank's ordered list. This is the
    explicit form of a rearrangement Pi (OrchMLLM §5.1) and of the all-to-all that applies it.
    """

    samples: tuple[int, ...]
    src: tuple[tuple[int, int], ...]
    dst: tuple[tuple[int, int], ...]
    num_src_ranks: int
    num_dst_ranks: int

    def apply(self, per_rank: Sequence[Sequence]) -> list[list]:
        """Move per-rank payloads (in src slot order) to per-rank lists in dst slot order."""
        if len(per_rank) != self.num_src_ranks:
            raise ValueError(f"expected {self.num_src_ranks} source ranks, got {len(per_rank)}")
        sizes = [0] * self.num_dst_ranks
        for r, s in self.dst:
            sizes[r] = max(sizes[r], s + 1)
        out: list[list] = [[None] * n for n in sizes]
        for (sr, ss), (dr, ds) in zip(self.src, self.dst):
            out[dr][ds] = per_rank[sr][ss]
        return out

    def inverse(self) -> "Rearrangement":
        """Pi^-1 (e.g. gradients flowing back from the LLM to the encoder)."""
        return Rearrangement(self.samples, self.dst, self.src, self.num_dst_ranks,
                             self.num_src_ranks)

    def then(self, other: "Rearrangement") -> "Rearrangement":
        """``other o self``: first self, then other (other's src must be self's dst)."""
        by_pos = {pos: k for k, pos in enumerate(other.src)}
        dst = []
        for pos in self.dst:
            if pos not in by_pos:
                raise ValueError(f"position {pos} of the first rearrangement is not moved by "
                                 "the second")
            dst.append(other.dst[by_pos[pos]])
        return Rearrangement(self.samples, self.src, tuple(dst), self.num_src_ranks,
                             other.num_dst_ranks)



def rearrangement(src_batches: Sequence[Sequence[int]],
                  dst_batches: Sequence[Sequence[int]]) -> Rearrangement:
    """The rearrangement taking the samples of ``src_batches`` to their slots in ``dst_batches``.

    Both are per-rank ordered lists of sample ids holding the same samples once each.
    """
    where: dict[int, tuple[int, int]] = {}
    for r, batch in enumerate(dst_batches):
        for slot, s in enumerate(batch):
            if s in where:
                raise ValueError(f"sample {s} appears twice in dst_batches")
            where[s] = (r, slot)
    flat = [s for batch in src_batches for s in batch]
    if len(flat) != len(set(flat)):
        raise ValueError("a sample appears twice in src_batches")
    samples, src, dst = [], [], []
    for r, batch in enumerate(src_batches):
        for slot, s in enumerate(batch):
            if s not in where:
                raise ValueError(f"sample {s} of src_batches is missing from dst_batches")
            samples.append(s)
            src.append((r, slot))
            dst.append(where.pop(s))
    if where:
        raise ValueError(f"samples {sorted(where)[:8]} of dst_batches are missing from src_batches")
    return Rearrangement(tuple(samples), tuple(src), tuple(dst), len(src_batches), len(dst_batches))


def compose_rearrangement(encoder_batches: Mapping[str, Sequence[Sequence[int]]],
                          llm_batches: Sequence[Sequence[int]]) -> dict[str, Rearrangement]:
    """Per encoder E, Pi_M o Pi_E^-1 (OrchMLLM §6): encoder outputs straight to their LLM rank.

    ``encoder_batches[E][r]``: sample ids encoder E runs on rank r (its balanced, node-wise
    placed batches; only samples that have E's modality). ``llm_batches[r]``: sample ids the
    LLM runs on rank r. Sample s's output moves from (encoder rank, slot) to (LLM rank, slot),
    the LLM slot counting only that rank's samples which have E's modality, in LLM order.
    Going through the original instances (Pi_E^-1, then Pi_M) lands every output in the same
    place, with one all-to-all instead of two.
    """
    out = {}
    for name, batches in encoder_batches.items():
        members = {s for b in batches for s in b}
        dst = [[s for s in b if s in members] for b in llm_batches]
        try:
            out[name] = rearrangement(batches, dst)
        except ValueError as e:
            raise ValueError(f"encoder {name!r}: {e}") from None
    return out
