"""Index tables of one ragged exchange (`lax.ragged_all_to_all`, GPU), built by NumPy over
every row at once from the deliveries the staged exchange uses (no JAX).

Device u packs the rows it sends to other devices into one send buffer, grouped by receiver
in device order (a pair's rows in delivery order); one ragged all-to-all moves each group
to its receiver, which stacks what it gets by sender, in device order. A device's rows to
itself never leave it: its output reads them from its own input. Per device, the
collective's four [n] vectors (the primitive's arguments, indexed by peer):

- `input_offsets[u, v]`, `send_sizes[u, v]`: where u's rows for v start in u's send buffer,
  and how many (0 for v == u);
- `output_offsets[u, v]`: where they land in v's receive buffer (the rows of senders
  before u to v);
- `recv_sizes[v, u]`: how many v gets from u (= send_sizes[u, v]).

A link carries the real rows only (`send_sizes`), whatever the buffers' shapes. The two
buffers are static (the compiled shapes): `caps = (send rows, receive rows)`, each the
busiest device's rows, bucketed like the staged capacities (`exchange_stages.bucket`: at
most 25% over, ~4 shapes per doubling), joined over a run (`join_caps`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmjax.parallel.deliveries import pair_counts
from mmjax.parallel.exchange_stages import bucket

RaggedCaps = tuple[int, int]  # (send buffer rows, receive buffer rows)
EXCHANGES = ("auto", "staged", "ragged")  # Loader.exchange: "auto" is staged (ragged is opt-in, GPU only)


@dataclass(frozen=True)
class RaggedTables:
    """One ragged exchange's tables on n devices. `take` [n, send cap]: the input row device
    u puts in each send-buffer row (-1: padding, never sent); the four [n, n] vectors of
    the collective (module docstring); `recv` [n, dst_slots]: per destination slot, its row
    in the pool [input rows; receive buffer] (-1: zeros); `count` [n, n]: rows u delivers
    to v (u == v included)."""

    caps: RaggedCaps
    take: np.ndarray
    input_offsets: np.ndarray
    send_sizes: np.ndarray
    output_offsets: np.ndarray
    recv_sizes: np.ndarray
    recv: np.ndarray
    count: np.ndarray

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The per-device tables, one row per device (what `ragged_exchange` reads);
        "buffer" [n, receive cap] (bool, False) carries the receive buffer's static shape."""
        return {"take": self.take, "input_offsets": self.input_offsets,
                "send_sizes": self.send_sizes, "output_offsets": self.output_offsets,
                "recv_sizes": self.recv_sizes, "recv": self.recv,
                "buffer": np.zeros((self.take.shape[0], self.caps[1]), bool)}


def _remote_counts(count: np.ndarray) -> np.ndarray:
    out = count.copy()
    np.fill_diagonal(out, 0)
    return out


def ragged_caps(count: np.ndarray) -> RaggedCaps:
    """The least bucketed (send, receive) buffer rows that carry `count` [n, n] (rows u
    delivers to v; the diagonal stays on its device)."""
    far = _remote_counts(np.asarray(count, np.int64))
    return (bucket(int(far.sum(axis=1).max(initial=0))),
            bucket(int(far.sum(axis=0).max(initial=0))))


def ragged_tables(ds, n: int, src_slots: int, dst_slots: int,
                  caps: RaggedCaps | None = None) -> RaggedTables:
    """Tables moving deliveries `ds` [(u, v, src slot, dst slot)] (`deliveries.deliveries_array`) by
    one ragged all-to-all over `n` devices; `caps`: the static buffer rows (None: this
    map's own, `ragged_caps`)."""
    u, v, s, q = np.asarray(ds, np.int64).reshape(-1, 4).T
    count = pair_counts(ds, n)
    need = ragged_caps(count)
    if caps is None:
        caps = need
    elif len(caps) != 2 or caps[0] < need[0] or caps[1] < need[1]:
        raise ValueError(f"ragged exchange: buffer rows {tuple(caps)} (send, receive) are "
                         f"below the rows this map moves, {need} (raise them: join_caps)")
    far = _remote_counts(count)
    input_offsets = np.cumsum(far, axis=1) - far            # by receiver, on the sender
    output_offsets = np.cumsum(far, axis=0) - far           # by sender, on the receiver
    order = np.lexsort((np.arange(len(u)), v, u))           # pairs in order, rows in order
    pair = (u * n + v)[order]
    start = np.r_[0, np.flatnonzero(pair[1:] != pair[:-1]) + 1] if len(pair) else pair
    rank = np.empty(len(u), np.int64)
    rank[order] = np.arange(len(u)) - np.repeat(start, np.diff(np.r_[start, len(u)]))
    remote = u != v
    take = np.full((n, caps[0]), -1, np.int32)
    take[u[remote], (input_offsets[u, v] + rank)[remote]] = s[remote]
    recv = np.full((n, dst_slots), -1, np.int32)
    recv[v, q] = np.where(remote, src_slots + output_offsets[u, v] + rank, s)
    i32 = lambda a: a.astype(np.int32)
    return RaggedTables((int(caps[0]), int(caps[1])), take, i32(input_offsets), i32(far),
                        i32(output_offsets), i32(far.T), recv, count)

