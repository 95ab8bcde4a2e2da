"""The broker's exchange as rounds of collective permutes over DistTrain's gcd groups (§7).

A transfer from a sub-mesh of DP size a to one of DP size b keeping sample order pairs each
source rank with the destinations of its own group of DistTrain's gcd(a, b) groups. The pairs
of source rank i and destination rank j are covered by matchings (rounds): first the
order-preserving pairs, grouped by overlap (so a round's pairs carry the same rows: an
ordered transfer pads nothing), then, in rounds of their own, every other pair, for rearranged maps (greedy edge
colouring). With replicas (tp / cp copies of a rank) each
destination replica r gets its own sub-round, served by the source replica on the same device
when there is one (a local copy), else by source replica r mod (its replica count).

Which rounds and sizes exist depends on the mesh pair only, never on the route map: a route
map fills rounds with rows, and a round no map has used sends nothing. An order-preserving
transfer (DistTrain's sample order) uses the first rounds only: each source rank exchanges
with the destinations of its own gcd group, the broker of §7. Each round's
capacity is its busiest pair's rows, bucketed (at most 25% over), so each device sends about
the rows it really has for others, never `n * C` of a union-wide all-to-all.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import numpy as np

from mmjax.data.routes import Routes
from mmjax.parallel.exchange_stages import bucket

Pair = tuple[int, int, int, int]  # (source rank i, destination rank j, sender u, receiver v)


def _greedy_matchings(pairs: list[tuple[int, int]], rounds: list[list[tuple[int, int]]]):
    """Put each pair, in order, into the first round where neither of its ranks is busy."""
    for i, j in pairs:
        for r in rounds:
            if all(i != x and j != y for x, y in r):
                r.append((i, j))
                break
        else:
            rounds.append([(i, j)])


def _ordered_overlaps(a: int, b: int) -> dict[tuple[int, int], int]:
    """(i, j) -> parts rank i sends rank j in DistTrain's order-preserving transfer."""
    overlap: dict[tuple[int, int], int] = {}
    for i, _, j, _ in Routes.order_preserving(a, b, a * b // gcd(a, b)).pairs:
        overlap[(i, j)] = overlap.get((i, j), 0) + 1
    return overlap


def _ordered_rounds(a: int, b: int) -> list[list[tuple[int, int]]]:
    overlap = _ordered_overlaps(a, b)
    rounds: list[list[tuple[int, int]]] = []
    for size in sorted(set(overlap.values()), reverse=True):  # a round's pairs: one size
        same: list[list[tuple[int, int]]] = []
        _greedy_matchings(sorted(p for p in overlap if overlap[p] == size), same)
        rounds += same
    return rounds


def ordered_round_count(a: int, b: int) -> int:
    """How many of `rank_rounds(a, b)` hold the order-preserving pairs (the first ones)."""
    return len(_ordered_rounds(a, b))


def rank_rounds(a: int, b: int) -> list[list[tuple[int, int]]]:
    """(source rank, destination rank) matchings that hold every pair once: first the pairs
    of DistTrain's order-preserving transfer (within the gcd(a, b) groups), one overlap size
    per round, largest first; then every other pair (a rearranged map's)."""
    overlap = _ordered_overlaps(a, b)
    rounds = _ordered_rounds(a, b)
    others: list[list[tuple[int, int]]] = []  # apart: an ordered transfer sends none of them
    rest = [(i, j) for i in range(a) for j in range(b) if (i, j) not in overlap]
    _greedy_matchings(sorted(rest, key=lambda p: ((p[1] - p[0]) % max(a, b), p)), others)
    return [sorted(r) for r in rounds + others]


def device_rounds(src_replicas: list[list[int]],
                  dst_replicas: list[list[int]]) -> list[tuple[Pair, ...]]:
    """Each rank round split into one round per destination replica index, with the sender
    device of every pair: a valid permutation (distinct senders, distinct receivers)."""
    reps = max(len(r) for r in dst_replicas)
    out = []
    for pairs in rank_rounds(len(src_replicas), len(dst_replicas)):
        for r in range(reps):
            one = []
            for i, j in pairs:
                if r >= len(dst_replicas[j]):
                    continue
                v = dst_replicas[j][r]
                src = src_replicas[i]
                u = v if v in src else src[r % len(src)]
                one.append((i, j, u, v))
            out.append(tuple(one))
    return out


@dataclass(frozen=True)
class RoundTables:
    """One transfer's tables. `caps[r]`: rows round r carries per pair (0: the round sends
    nothing); `send[u, o_r + c]`: the source slot device u sends as row c of round r (-1:
    nothing); `recv[v, q]`: where device v reads destination slot q in the concatenation of
    the rounds' received rows (-1: zeros); `count[u, v]`: parts device u delivers to v."""

    caps: tuple[int, ...]
    send: np.ndarray
    recv: np.ndarray
    count: np.ndarray

    @property
    def capacity(self) -> int:
        """The largest round's rows per pair."""
        return max(self.caps, default=0)


def parts_by_rank_pair(routes: Routes) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(i, j) -> the (source slot, destination slot) parts rank i sends rank j, in map order."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, s, j, q in routes.pairs:
        out.setdefault((i, j), []).append((s, q))
    return out


def needed_caps(routes: Routes, rounds: list[tuple[Pair, ...]],
                shared_from: int | None = None) -> tuple[int, ...]:
    """Per round, its busiest pair's parts, bucketed. The rounds from `shared_from` on (those
    only a rearranged map uses) share one size, their busiest: a stream of rearranged maps
    then grows one size a few times, not each round's as maps happen to fill it."""
    parts = parts_by_rank_pair(routes)
    busiest = [max((len(parts.get((i, j), ())) for i, j, _, _ in rnd), default=0)
               for rnd in rounds]
    if shared_from is not None and shared_from < len(rounds):
        busiest[shared_from:] = [max(busiest[shared_from:])] * (len(rounds) - shared_from)
    return tuple(bucket(k) for k in busiest)


def round_tables(routes: Routes, rounds: list[tuple[Pair, ...]], n: int,
                 caps: tuple[int, ...]) -> RoundTables:
    """Fill the rounds with `routes`' parts; `caps` (at least `needed_caps`) fixes the shapes."""
    parts = parts_by_rank_pair(routes)
    total = sum(caps)
    send = np.full((n, total), -1, np.int32)
    recv = np.full((n, routes.dst_slots), -1, np.int32)
    count = np.zeros((n, n), np.int64)
    offset = 0
    for rnd, cap in zip(rounds, caps):
        for i, j, u, v in rnd:
            moved = parts.get((i, j), ())
            if len(moved) > cap:
                raise ValueError(f"broker round carries {len(moved)} parts from rank {i} to "
                                 f"rank {j}, over its capacity {cap}")
            for c, (s, q) in enumerate(moved):
                send[u, offset + c] = s
                recv[v, q] = offset + c
            count[u, v] += len(moved)
        offset += cap
    return RoundTables(tuple(caps), send, recv, count)


def permutes(rounds: list[tuple[Pair, ...]], caps: tuple[int, ...]
             ) -> list[tuple[tuple[tuple[int, int], ...], int, int]]:
    """The compiled program's collective permutes: (sender -> receiver pairs, row offset,
    rows) of each round that carries rows."""
    out, offset = [], 0
    for rnd, cap in zip(rounds, caps):
        if cap:
            out.append((tuple((u, v) for _, _, u, v in rnd), offset, cap))
        offset += cap
    return out


def sent_rows(rounds: list[tuple[Pair, ...]], caps: tuple[int, ...]) -> dict[int, int]:
    """Sender device -> rows it puts on a link per transfer: per round, the round's size for
    each of its pairs between two different devices (what the compiled program sends)."""
    rows: dict[int, int] = {}
    for rnd, cap in zip(rounds, caps):
        for _, _, u, v in rnd:
            if cap and u != v:
                rows[u] = rows.get(u, 0) + cap
    return rows
