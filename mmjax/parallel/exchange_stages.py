"""Host plan of a staged exchange: rows move between devices by collective permutes whose
buffers are sized to the rows each stage really carries (no JAX; numpy only).

n devices are N nodes of `rpn` (device position p is local index p % rpn on node p // rpn,
the `TrafficLedger` convention). A row from device u = (a, i) to device v = (b, j) goes:

- a == b: stage A, the intra-node shift (j - i) % rpn, straight to v (nothing if u == v);
- a != b: to a relay r on node a (stage A, shift (r - i) % rpn, skipped when r == i), across
  to (b, r) (stage B), then to v (stage C, shift (j - r) % rpn, skipped when r == j). Stage B
  routes on the node ring by the binary digits of (b - a) % N: hop d moves a row 2^d nodes
  on (always to the same local index r) when digit d is set, so there are ceil(log2 N) hops,
  not N - 1 shifts, and a device's inter-node rows cost O(log N) permutes of about the rows
  it really carries, not one permute per node shift sized by the busiest pair at that shift.

Each shift is one collective permute of every device to its shift target with a static
capacity (rows): the stage's busiest device for that shift, rounded up by `bucket` (at most
25% over, a bounded set of shapes). Relays split node a's rows for node b evenly: with T
rows a -> b, no relay carries more than ceil(T / rpn) of them (own index first, then the
destination's, then the least loaded), so stage B's capacity follows the real inter-node
rows between the busiest node pair, not the busiest device pair. The compiled program then
sends n * capacity rows per shift, which is what `caps_bytes` counts per link class.

`Caps` is the static part (the compiled shapes): per shift, its capacity, stages A, B, C
flattened: rpn - 1, ceil(log2 N), rpn - 1 entries (shift 1 first; 0: no collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

Caps = tuple[int, ...]
Counts = Union[dict[tuple[int, int], int], np.ndarray]  # {(u, v): rows}, or [n, n]


def bucket(k: int) -> int:
    """The least of 0, 1, 2, 3, then m * 2^e with m in 4..7 that is >= k: a capacity at most
    25% above the rows it holds (k >= 4), ~4 shapes per doubling."""
    if k <= 3:
        return max(int(k), 0)
    e = max(int(k - 1).bit_length() - 3, 0)  # k - 1 < 8 * 2^e
    return -(-int(k) // (1 << e)) * (1 << e)


@dataclass(frozen=True)
class Topology:
    """n devices as `nodes` nodes of `rpn` (position p: node p // rpn, local p % rpn)."""

    n: int
    rpn: int

    def __post_init__(self):
        if self.rpn < 1 or self.n % self.rpn:
            raise ValueError(f"exchange: {self.n} devices are not whole nodes of {self.rpn} "
                             f"(use a ranks_per_node dividing {self.n})")

    @property
    def nodes(self) -> int:
        return self.n // self.rpn

    @property
    def hops(self) -> int:
        """Stage B's hops: binary digits of the largest node distance, ceil(log2 N)."""
        return (self.nodes - 1).bit_length()

    def shifts(self) -> list[tuple[str, int]]:
        """(stage, shift) of every entry of a `Caps`, in order."""
        return ([("A", s) for s in range(1, self.rpn)]
                + [("B", 1 << d) for d in range(self.hops)]
                + [("C", s) for s in range(1, self.rpn)])

    def node_hops(self, a: int, b: int) -> list[tuple[int, int]]:
        """Stage B's (shift, node the row leaves from) hops from node a to node b."""
        out, c, delta = [], a, (b - a) % self.nodes
        for d in range(self.hops):
            if delta >> d & 1:
                out.append((1 << d, c))
                c = (c + (1 << d)) % self.nodes
        assert c == b
        return out

    def target(self, stage: str, shift: int, p: int) -> int:
        """Where device p sends in this stage's shift."""
        a, i = divmod(p, self.rpn)
        if stage == "B":
            return ((a + shift) % self.nodes) * self.rpn + i
        return a * self.rpn + (i + shift) % self.rpn

    def perm(self, stage: str, shift: int) -> list[tuple[int, int]]:
        return [(p, self.target(stage, shift, p)) for p in range(self.n)]


def _count_arrays(count) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`count` {(u, v): rows}, or a [n, n] matrix of rows, as arrays u, v, rows sorted by
    (u, v), rows > 0 only."""
    if isinstance(count, np.ndarray):
        u, v = np.nonzero(count)
        return u.astype(np.int64), v.astype(np.int64), count[u, v].astype(np.int64)
    if not count:
        return (np.zeros(0, np.int64),) * 3
    uv = np.array(list(count), np.int64).reshape(-1, 2)
    m = np.fromiter(count.values(), np.int64, len(count))
    order = np.lexsort((uv[:, 1], uv[:, 0]))
    uv, m = uv[order], m[order]
    keep = m > 0
    return uv[keep, 0], uv[keep, 1], m[keep]


def _fill(key: np.ndarray, amount: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Per element, in order, the part of `amount` that fits under its group's `cap` after
    the earlier elements of the same group (`key`: any group ids; a stable pass over each
    group in element order, vectorised as clipped in-group prefix sums)."""
    out = np.zeros_like(amount)
    if not len(key):
        return out
    s = np.argsort(key, kind="stable")
    k, x = key[s], amount[s]
    total = np.cumsum(x)
    start = np.r_[0, np.flatnonzero(k[1:] != k[:-1]) + 1]
    base = np.repeat(np.r_[0, total[start[1:] - 1]], np.diff(np.r_[start, len(k)]))
    incl = total - base
    out[s] = np.minimum(incl, cap[s]) - np.minimum(incl - x, cap[s])
    return out


def relay_rows(count: Counts, topo: Topology
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The inter-node rows of `count` with their relays, as arrays (u, v, relay local index,
    rows). Per node pair a -> b with T rows, no relay carries more than ceil(T / rpn): each
    move takes its own index first (diagonal moves i == j first), then the destination's,
    then the least loaded relays' room (module docstring). Every pass is vectorised over
    all node pairs (clipped prefix sums, interval cuts). Depends only on `count`'s
    contents, not its order, so capacities planned from one count carry the tables built
    from another."""
    u, v, m = _count_arrays(count)
    return _relay_arrays(u, v, m, topo)


def _relay_arrays(u, v, m, topo: Topology):
    """`relay_rows` on the sorted count arrays."""
    rpn = topo.rpn
    a, i = np.divmod(u, rpn)
    b, j = np.divmod(v, rpn)
    inter = a != b
    u, v, m, a, i, b, j = (x[inter] for x in (u, v, m, a, i, b, j))
    pair = a * topo.nodes + b
    order = np.lexsort((j, i, i != j, pair))  # per pair: diagonal moves first, then by (i, j)
    u, v, m, i, j, pair = (x[order] for x in (u, v, m, i, j, pair))
    pairs, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    quota = -(-np.add.reduceat(m, first) // rpn) if len(m) else np.zeros(0, np.int64)
    load = np.zeros((len(pairs), rpn), np.int64)
    take1 = _fill(inverse * rpn + i, m, quota[inverse])
    np.add.at(load, (inverse, i), take1)
    rest = m - take1
    take2 = _fill(inverse * rpn + j, rest, quota[inverse] - load[inverse, j])
    np.add.at(load, (inverse, j), take2)
    left = rest - take2
    rows = [(u, v, i, take1), (u, v, j, take2), _spread(u, v, left, inverse, quota, load)]
    out = tuple(np.concatenate(x) for x in zip(*rows))
    keep = out[3] > 0
    return out[0][keep], out[1][keep], out[2][keep], out[3][keep]


def _spread(u, v, left, inverse, quota, load):
    """Pass three of `relay_rows`: each node pair's remaining rows go to its relays by water
    filling (the least loaded raised to one level, as even as whole rows allow; the extra
    rows of an uneven level to the least loaded, lowest index first), as one stream in move
    order cut over those rooms in that relay order. The level stays <= quota (rpn * quota
    >= T). Vectorised: [pairs, rpn] arrays, and one interval cut over a global line where
    pair p's relays and moves sit at offset base[p]."""
    pairs, rpn = load.shape
    want = np.bincount(inverse, weights=left, minlength=pairs).astype(np.int64)
    relay_order = np.lexsort((np.tile(np.arange(rpn), pairs), load.ravel(),
                              np.repeat(np.arange(pairs), rpn))).reshape(pairs, rpn)
    low = np.take_along_axis(load, relay_order % rpn, axis=1)  # loads, ascending
    total = want[:, None] + np.cumsum(low, axis=1)  # rows to share among the k lowest
    k = np.arange(1, rpn + 1)
    fits = np.ones((pairs, rpn), bool)  # the k lowest reach a level at most the next load
    fits[:, :-1] = total[:, :-1] <= low[:, 1:] * k[:-1]
    kk = np.argmax(fits, axis=1) + 1
    tot = total[np.arange(pairs), kk - 1]
    level, extra = tot // kk, tot % kk
    rank = np.arange(rpn)[None, :]
    room = np.where(rank < kk[:, None], level[:, None] - low + (rank < extra[:, None]), 0)
    room = room.ravel()
    r_end = np.cumsum(room)
    r_start = r_end - room
    base = np.r_[0, r_end[rpn - 1::rpn]][:-1] if pairs else np.zeros(0, np.int64)
    mv = np.flatnonzero(left)
    m = left[mv]
    p = inverse[mv]
    pair_total = np.cumsum(m)
    first = np.r_[True, p[1:] != p[:-1]] if len(p) else np.zeros(0, bool)
    before = np.maximum.accumulate(np.where(first, pair_total - m, 0)) if len(p) else m
    s = base[p] + pair_total - m - before
    e = s + m
    k0 = np.searchsorted(r_end, s, side="right")
    k1 = np.searchsorted(r_end, e, side="left")
    pieces = k1 - k0 + 1
    move = np.repeat(np.arange(len(mv)), pieces)
    at = np.repeat(k0 - np.r_[0, np.cumsum(pieces)[:-1]], pieces) + np.arange(pieces.sum())
    got = np.minimum(e[move], r_end[at]) - np.maximum(s[move], r_start[at])
    return u[mv][move], v[mv][move], relay_order.ravel()[at] % rpn, got


def routing(count: Counts, topo: Topology
            ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per inter-node device pair (u, v) with rows, [(relay local index, rows)] in the order
    a row takes them (`relay_rows`); intra-node pairs go direct (absent here)."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for u, v, r, m in zip(*(x.tolist() for x in relay_rows(count, topo))):
        out.setdefault((u, v), []).append((r, m))
    return out


def stage_loads(count: Counts, topo: Topology) -> np.ndarray:
    """[len(shifts), n]: rows each device sends in each shift of the staged exchange
    (vectorised over the hops: NumPy scatter-adds, one per stage and hop)."""
    rpn, nodes, n = topo.rpn, topo.nodes, topo.n
    a_rows, b_rows = rpn - 1, topo.hops  # Caps layout: A shifts, B hops, C shifts
    rows = np.zeros((2 * a_rows + b_rows) * n, np.int64)  # flat [shift, device]

    def add(shift, device, m):
        np.add.at(rows, shift * n + device, m)

    u, v, m = _count_arrays(count)
    direct = (u // rpn == v // rpn) & (u != v)
    add((v - u)[direct] % rpn - 1, u[direct], m[direct])
    u, v, r, m = _relay_arrays(u, v, m, topo)
    a, i = np.divmod(u, rpn)
    b, j = np.divmod(v, rpn)
    moved = r != i
    add((r - i)[moved] % rpn - 1, u[moved], m[moved])
    delta = (b - a) % nodes
    for d in range(b_rows):
        on = (delta >> d & 1).astype(bool)
        node = (a + (delta & ((1 << d) - 1))) % nodes  # where the row is before hop d
        add(a_rows + d, (node * rpn + r)[on], m[on])
    last = r != j
    add(a_rows + b_rows + (j - r)[last] % rpn - 1, (b * rpn + r)[last], m[last])
    return rows.reshape(-1, n)


def needed_caps(count: Counts, topo: Topology) -> Caps:
    """The least bucketed capacities that carry `count` ({(u, v): rows})."""
    load = stage_loads(count, topo)
    return tuple(bucket(int(x)) for x in load.max(axis=1, initial=0))


def join_caps(*caps: Caps) -> Caps:
    """Elementwise max (a run's capacities only grow, so its program compiles once)."""
    return tuple(max(c) for c in zip(*caps))


def caps_bytes(caps: Caps, topo: Topology, row_bytes: int,
               ranks_per_node: int | None = None) -> dict[str, int]:
    """Bytes the compiled staged exchange sends per link class: every device sends `cap`
    rows in each shift with cap > 0, to its shift target; a pair is inter-node when its
    devices sit on different nodes of `ranks_per_node` (default: the topology's)."""
    rpn = ranks_per_node or topo.rpn
    out = {"intra_node": 0, "inter_node": 0}
    for (stage, shift), cap in zip(topo.shifts(), caps):
        for p, t in topo.perm(stage, shift):
            out["inter_node" if p // rpn != t // rpn else "intra_node"] += cap * row_bytes
    return out
