"""References for the ragged exchange, which XLA:CPU cannot run: a row walk building its tables
one delivery at a time, and a NumPy model of `lax.ragged_all_to_all` as its documentation
states it, applied with the tables (the device body `ragged_exchange.ragged_body`, step by
step)."""
from __future__ import annotations

import numpy as np

from mmjax.parallel.ragged_tables import RaggedTables


def walk_tables(ds, n: int, src_slots: int, dst_slots: int) -> dict[str, np.ndarray]:
    """The tables by walking the deliveries (u, v, s, q) in order: sender u's rows for v
    sit in its send buffer after its rows for receivers < v; v stacks its senders' rows by
    sender; a device's rows to itself are read from its input."""
    per_pair: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for u, v, s, q in ds:
        per_pair.setdefault((u, v), []).append((s, q))
    sizes = np.zeros((n, n), np.int64)
    for (u, v), rows in per_pair.items():
        if u != v:
            sizes[u, v] = len(rows)
    in_off = np.zeros((n, n), np.int64)
    out_off = np.zeros((n, n), np.int64)
    for u in range(n):
        for v in range(n):
            in_off[u, v] = sum(sizes[u, w] for w in range(v))
            out_off[u, v] = sum(sizes[w, v] for w in range(u))
    take: dict[tuple[int, int], int] = {}
    recv = np.full((n, dst_slots), -1, np.int64)
    for (u, v), rows in per_pair.items():
        for k, (s, q) in enumerate(rows):
            if u == v:
                recv[v, q] = s
            else:
                take[(u, in_off[u, v] + k)] = s
                recv[v, q] = src_slots + out_off[u, v] + k
    return {"input_offsets": in_off, "send_sizes": sizes, "output_offsets": out_off,
            "recv_sizes": sizes.T, "recv": recv, "take": take}


def _gather(x: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Per device, rows `idx` of its x (-1: zeros)."""
    trail = (1,) * (x.ndim - 2)
    got = np.take_along_axis(x, np.maximum(idx, 0).reshape(idx.shape + trail), axis=1)
    return np.where((idx >= 0).reshape(idx.shape + trail), got, 0).astype(x.dtype)


def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """`lax.ragged_all_to_all` over every device at once ([n, ...] per argument), as its
    documentation states: sender u's slice input_offsets[u, v] +: send_sizes[u, v] lands at
    output_offsets[u, v] of v's output; recv_sizes[v, u] must say the same size."""
    n = operand.shape[0]
    assert np.array_equal(recv_sizes, send_sizes.T), "recv_sizes is not send_sizes transposed"
    result = output.copy()
    for u in range(n):
        for v in range(n):
            m, i, o = int(send_sizes[u, v]), int(input_offsets[u, v]), int(output_offsets[u, v])
            assert i + m <= operand.shape[1] and o + m <= output.shape[1], "slice out of bounds"
            result[v, o:o + m] = operand[u, i:i + m]
    return result


def emulate(xs: np.ndarray, t: RaggedTables) -> np.ndarray:
    """The device body on every device: xs [n, src_slots, ...] -> [n, dst_slots, ...]."""
    buf = _gather(xs, t.take)
    out = np.zeros((xs.shape[0], t.caps[1]) + xs.shape[2:], xs.dtype)
    got = ragged_all_to_all(buf, out, t.input_offsets, t.send_sizes, t.output_offsets,
                            t.recv_sizes)
    return _gather(np.concatenate([xs, got], axis=1), t.recv)


def walk_deliveries(routes, src_replicas, dst_replicas) -> list[tuple[int, int, int, int]]:
    """The per-row walk `deliveries.deliveries_array` replaced (broker.py before it): every
    part to every replica of its destination rank; the receiver itself when it holds the
    source rank, else the source replica with the fewest deliveries to that receiver, then
    fewest in all, then the first."""
    load = {d: 0 for reps in src_replicas for d in reps}
    pair: dict[tuple[int, int], int] = {}
    out = []
    for i, s, j, q in routes.pairs:
        reps = src_replicas[i]
        for v in dst_replicas[j]:
            u = v if v in reps else min(
                reps, key=lambda d: (pair.get((d, v), 0), load[d], reps.index(d)))
            load[u] += 1
            pair[(u, v)] = pair.get((u, v), 0) + 1
            out.append((u, v, s, q))
    return out
