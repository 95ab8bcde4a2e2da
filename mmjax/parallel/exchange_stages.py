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

import numpy as np

Caps = tuple[int, ...]


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


def _relays(moves: list[tuple[int, int, int]], rpn: int) -> list[tuple[int, int, int, int]]:
    """One node pair's rows `moves` [(i, j, rows)] -> [(i, j, relay r, rows)] with at most
    ceil(total / rpn) rows on any relay (module docstring)."""
    total = sum(m for _, _, m in moves)
    quota = -(-total // rpn)
    load = [0] * rpn
    out, rest = [], []
    for i, j, m in sorted(moves, key=lambda t: t[0] != t[1]):  # i == j: no hop at all
        take = min(m, quota - load[i])
        if take:
            out.append((i, j, i, take))
            load[i] += take
        if m - take:
            rest.append((i, j, m - take))
    left = []
    for i, j, m in rest:
        take = min(m, quota - load[j])
        if take:
            out.append((i, j, j, take))
            load[j] += take
        if m - take:
            left.append((i, j, m - take))
    for i, j, m in left:
        while m:
            r = min(range(rpn), key=lambda x: (load[x], x))
            take = min(m, quota - load[r])
            out.append((i, j, r, take))
            load[r] += take
            m -= take
    return out


def routing(count: dict[tuple[int, int], int], topo: Topology
            ) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Per inter-node device pair (u, v) with rows, [(relay local index, rows)]; intra-node
    pairs go direct (absent here). The same for any order of `count`'s entries, so
    capacities planned from one count carry the tables built from another."""
    by_nodes: dict[tuple[int, int], list] = {}
    for (u, v), m in sorted(count.items()):  # the relays do not depend on the dict's order
        a, i = divmod(u, topo.rpn)
        b, j = divmod(v, topo.rpn)
        if a != b and m:
            by_nodes.setdefault((a, b), []).append((i, j, m))
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for (a, b), moves in by_nodes.items():
        for i, j, r, m in _relays(moves, topo.rpn):
            out.setdefault((a * topo.rpn + i, b * topo.rpn + j), []).append((r, m))
    return out


def stage_loads(count: dict[tuple[int, int], int], topo: Topology) -> np.ndarray:
    """[len(shifts), n]: rows each device sends in each shift of the staged exchange
    (vectorised over the hops: NumPy scatter-adds, one per stage and hop)."""
    rpn, nodes, n = topo.rpn, topo.nodes, topo.n
    a_rows, b_rows = rpn - 1, topo.hops  # Caps layout: A shifts, B hops, C shifts
    load = np.zeros((2 * a_rows + b_rows, n), np.int64)
    direct = [(u, v, m) for (u, v), m in count.items()
              if u // rpn == v // rpn and u != v and m]
    if direct:
        u, v, m = map(np.asarray, zip(*direct))
        np.add.at(load, ((v - u) % rpn - 1, u), m)
    hops = [(u, v, r, m) for (u, v), rs in routing(count, topo).items() for r, m in rs]
    if hops:
        u, v, r, m = map(np.asarray, zip(*hops))
        a, i = np.divmod(u, rpn)
        b, j = np.divmod(v, rpn)
        moved = r != i
        np.add.at(load, ((r - i)[moved] % rpn - 1, u[moved]), m[moved])
        delta = (b - a) % nodes
        for d in range(b_rows):
            on = (delta >> d & 1).astype(bool)
            node = (a + (delta & ((1 << d) - 1))) % nodes  # where the row is before hop d
            np.add.at(load, (np.full(on.sum(), a_rows + d), (node * rpn + r)[on]), m[on])
        last = r != j
        np.add.at(load, (a_rows + b_rows + (j - r)[last] % rpn - 1, (b * rpn + r)[last]),
                  m[last])
    return load


def needed_caps(count: dict[tuple[int, int], int], topo: Topology) -> Caps:
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


@dataclass(frozen=True)
class StagedTables:
    """Index tables of one staged exchange. `send[k]` [n, caps[k]]: the pool rows device p
    puts in shift k's buffer (-1: padding); `recv` [n, dst_slots]: the final pool row of
    each destination slot (-1: zeros). A device's pool is its input rows, then each shift's
    received buffer in `topo.shifts()` order, appended stage by stage."""

    topo: Topology
    caps: Caps
    send: tuple[np.ndarray, ...]
    recv: np.ndarray
    count: np.ndarray  # [n, n] rows device u delivers to device v (u == v included)


def staged_tables(ds, topo: Topology, src_slots: int, dst_slots: int,
                  caps: Caps | None = None) -> StagedTables:
    """Tables moving deliveries `ds` [(u, v, src slot, dst slot)] (broker.deliveries) by the
    staged exchange; `caps`: the static capacities (None: `needed_caps`, bucketed)."""
    n, rpn = topo.n, topo.rpn
    count = np.zeros((n, n), np.int64)
    for u, v, _, _ in ds:
        count[u, v] += 1
    pairs = {(int(u), int(v)): int(count[u, v]) for u, v in zip(*np.nonzero(count))}
    need = needed_caps(pairs, topo)
    if caps is None:
        caps = need
    elif len(caps) != len(need) or any(c < k for c, k in zip(caps, need)):
        raise ValueError(f"exchange: capacities {tuple(caps)} (rows per shift) are below the "
                         f"rows this map sends, {need} (raise them: join_caps)")
    shifts = topo.shifts()
    index = {sh: k for k, sh in enumerate(shifts)}
    offset = np.cumsum([src_slots] + list(caps))[:-1]  # pool row of shift k's block
    send = [np.full((n, c), -1, np.int32) for c in caps]
    used = np.zeros((len(shifts), n), np.int64)
    recv = np.full((n, dst_slots), -1, np.int32)

    def hop(stage, shift, p, row):
        k = index[(stage, shift)]
        c = used[k, p]
        used[k, p] += 1
        send[k][p, c] = row
        return topo.target(stage, shift, p), int(offset[k] + c)

    plan = {key: [r for r, m in hops for _ in range(m)]
            for key, hops in routing(pairs, topo).items()}
    taken: dict[tuple[int, int], int] = {}
    for u, v, s, q in ds:
        a, i = divmod(u, rpn)
        b, j = divmod(v, rpn)
        p, row = u, s
        if a == b:
            if i != j:
                p, row = hop("A", (j - i) % rpn, p, row)
        else:
            t = taken.get((u, v), 0)
            taken[(u, v)] = t + 1
            r = plan[(u, v)][t]
            if r != i:
                p, row = hop("A", (r - i) % rpn, p, row)
            for shift, _ in topo.node_hops(a, b):
                p, row = hop("B", shift, p, row)
            if r != j:
                p, row = hop("C", (j - r) % rpn, p, row)
        assert p == v
        recv[v, q] = row
    return StagedTables(topo, tuple(caps), tuple(send), recv, count)
