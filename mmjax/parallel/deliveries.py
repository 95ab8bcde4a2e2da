"""Which replica sends each part of a route map (host, NumPy; no JAX): the deliveries both
exchanges' tables are built from (`exchange_tables.staged_tables`, `ragged_tables`, the
broker's ragged form).

Every part goes to every replica of its destination rank; a receiver that is itself a
replica of the source rank sends to itself, otherwise the source replica with the fewest
deliveries to that receiver so far (then the fewest in all, then the first) sends, which
keeps the per-pair capacity low. Parts are taken in destination order (rank, slot), each
destination's replicas in order. Vectorised: a source rank of one replica, or a receiver
holding the source rank, decides the sender directly; the greedy choices of source ranks
with several replicas run as one step per delivery of the busiest such rank, every such
rank at once (their replicas are disjoint devices, so their counts never meet).
"""
from __future__ import annotations

from itertools import chain

import numpy as np

from mmjax.data.routes import Routes


def _route_arrays(routes: Routes) -> tuple[np.ndarray, ...]:
    """(source rank, source slot, destination rank, destination slot) of every filled
    destination slot, in destination order."""
    none = (-1, -1)
    flat = np.fromiter(chain.from_iterable(x or none for x in routes.sources), np.int64,
                       2 * len(routes.sources)).reshape(-1, 2)
    dst = np.flatnonzero(flat[:, 0] >= 0)
    return flat[dst, 0], flat[dst, 1], dst // routes.dst_slots, dst % routes.dst_slots


def _padded(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged int lists as a [len, longest] array padded with -1, and their lengths."""
    sizes = np.array([len(x) for x in lists], np.int64)
    out = np.full((len(lists), max(sizes.max(initial=0), 1)), -1, np.int64)
    for r, x in enumerate(lists):
        out[r, :len(x)] = x
    return out, sizes


def deliveries_array(routes: Routes, src_replicas: list[list[int]],
                     dst_replicas: list[list[int]]) -> np.ndarray:
    """[rows, 4] int64 (sender u, receiver v, src slot s, dst slot q) in union device
    indices (module docstring)."""
    i, s, j, q = _route_arrays(routes)
    src_reps, src_n = _padded(src_replicas)
    dst_reps, dst_n = _padded(dst_replicas)
    per = dst_n[j]
    row = np.repeat(np.arange(len(i)), per)
    rep = np.arange(len(row)) - np.repeat(np.cumsum(per) - per, per)
    i, s, j, q = i[row], s[row], j[row], q[row]
    v = dst_reps[j, rep]
    devices = int(max(src_reps.max(initial=0), dst_reps.max(initial=0))) + 1
    owner = np.full(devices, -1, np.int64)  # device -> the source rank it holds
    for r, reps in enumerate(src_replicas):
        owner[reps] = r
    u = np.where(owner[v] == i, v, src_reps[i, 0])
    multi = src_n[i] > 1
    if multi.any():
        u[multi] = _greedy(i[multi], v[multi], owner[v[multi]] == i[multi], src_reps, src_n,
                           devices)
    return np.stack([u, v, s, q], axis=1)


def _greedy(i, v, own, src_reps, src_n, devices: int) -> np.ndarray:
    """Senders of the deliveries (rank i -> receiver v, in order; `own`: v holds rank i)
    of source ranks with several replicas: step t takes every rank's t-th delivery."""
    ranks, first = np.unique(i, return_inverse=True)
    order = np.argsort(first, kind="stable")
    step = np.empty(len(i), np.int64)
    counts = np.bincount(first, minlength=len(ranks))
    step[order] = np.arange(len(i)) - np.repeat(np.cumsum(counts) - counts, counts)
    reps = src_reps[ranks]                                   # [ranks, replicas], -1 padded
    width = reps.shape[1]
    valid = np.arange(width)[None, :] < src_n[ranks][:, None]
    pair = np.zeros((devices, devices), np.int64)            # deliveries (sender, receiver)
    load = np.zeros(devices, np.int64)
    big = 1 << 40
    u = np.empty(len(i), np.int64)
    by_step = np.argsort(step, kind="stable")
    bounds = np.r_[0, np.cumsum(np.bincount(step, minlength=step.max(initial=-1) + 1))]
    for t in range(len(bounds) - 1):
        at = by_step[bounds[t]:bounds[t + 1]]                # one delivery per rank
        r, vv = first[at], v[at]
        d = reps[r]
        key = (pair[np.maximum(d, 0), vv[:, None]] * big + load[np.maximum(d, 0)] * width
               + np.arange(width)[None, :])
        key = np.where(valid[r], key, np.iinfo(np.int64).max)
        pick = np.where(own[at], vv, d[np.arange(len(at)), np.argmin(key, axis=1)])
        u[at] = pick
        pair[pick, vv] += 1
        load[pick] += 1
    return u



def pair_counts(ds, n: int) -> np.ndarray:
    """[n, n] deliveries per (sender, receiver) of `ds` [(u, v, s, q)]."""
    d = np.asarray(ds, np.int64).reshape(-1, 4)
    out = np.zeros((n, n), np.int64)
    np.add.at(out, (d[:, 0], d[:, 1]), 1)
    return out
