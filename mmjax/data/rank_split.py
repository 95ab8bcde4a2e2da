"""One unit's samples over its DP ranks as two arrays: the sample indices rank after rank and
the count per rank. The balancers (data/balance/) return this form, the batch plan keeps it
and the feed reads it, so no per-sample Python list is built on the way (at 2560 ranks x 60
samples, building those lists cost more than the balancing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class RankSplit:
    """`items[starts[r]:starts[r] + counts[r]]` are rank r's samples, in its order."""

    items: np.ndarray  # int64 sample indices, rank after rank
    counts: np.ndarray  # int64 [dp]

    @classmethod
    def contiguous(cls, n: int, dp: int) -> "RankSplit":
        """Samples in order, rank r taking the next n // dp (+1 for the first n % dp ranks)."""
        k, r = divmod(int(n), int(dp))
        counts = np.full(dp, k, dtype=np.int64)
        counts[:r] += 1
        return cls(np.arange(n, dtype=np.int64), counts)

    @classmethod
    def from_lists(cls, groups: Sequence[Sequence[int]]) -> "RankSplit":
        counts = np.array([len(g) for g in groups], dtype=np.int64)
        items = np.fromiter((int(s) for g in groups for s in g), np.int64, int(counts.sum()))
        return cls(items, counts)

    @property
    def dp(self) -> int:
        return int(self.counts.size)

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts

    def rank(self, r: int) -> np.ndarray:
        s = int(self.counts[:r].sum())
        return self.items[s:s + int(self.counts[r])]

    def by_rank(self) -> list[np.ndarray]:
        return np.split(self.items, np.cumsum(self.counts)[:-1])

    def lists(self) -> list[list[int]]:
        """One Python list of sample indices per rank."""
        if self.counts.size and self.counts.min() == self.counts.max():
            return self.items.reshape(self.counts.size, -1).tolist()
        items = self.items.tolist()
        ends = np.cumsum(self.counts).tolist()
        return [items[s:e] for s, e in zip([0] + ends[:-1], ends)]

    def permute_ranks(self, perm: Sequence[int] | np.ndarray) -> "RankSplit":
        """Batch i moves to rank perm[i] (node-wise rearrangement, OrchMLLM §5.2.2)."""
        order = np.asarray(perm, dtype=np.int64)
        if order.shape != self.counts.shape or not np.array_equal(np.sort(order),
                                                                 np.arange(self.dp)):
            raise ValueError(f"perm must be a permutation of range({self.dp})")
        batch_of_rank = np.argsort(order)
        counts = self.counts[batch_of_rank]
        starts = self.starts[batch_of_rank]
        idx = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(self.items.size)
        return RankSplit(self.items[idx], counts)

    def check(self, n: int, dp: int, name: str) -> None:
        """Every sample 0..n-1 exactly once over exactly `dp` ranks, else ValueError."""
        ok = (self.dp == dp and self.items.size == n and int(self.counts.sum()) == n
              and (n == 0 or (self.items.min() >= 0 and self.items.max() < n
                              and np.bincount(self.items, minlength=n).max() == 1)))
        if not ok:
            raise ValueError(f"{name} must split samples 0..{n - 1} over {dp} ranks")
