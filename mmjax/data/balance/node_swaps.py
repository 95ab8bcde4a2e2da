"""Pairwise-swap local search for the node-wise rearrangement (OrchMLLM §5.2.2, Algorithm 3's
objective): improves a placement of new mini-batches on nodes by exchanging two batches of
different nodes, every pair evaluated at once in numpy. Gives the MILP a better warm start
and is a fast path of its own."""
from __future__ import annotations

import numpy as np


def _top3(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of the three largest entries (fewer if ``a`` is shorter), -inf
    padded, so 'largest outside two excluded indices' is a lookup."""
    k = min(3, a.size)
    idx = np.argsort(-a, kind="stable")[:k]
    pad = 3 - k
    return (np.r_[idx, np.full(pad, -1)], np.r_[a[idx], np.full(pad, -np.inf)])


def _max_without(idx, val, i, j) -> np.ndarray:
    """max of an array without entries i and j (broadcast arrays), from its `_top3`."""
    out = np.where((idx[0] != i) & (idx[0] != j), val[0],
                   np.where((idx[1] != i) & (idx[1] != j), val[1], val[2]))
    return out


def swap_improve(v: np.ndarray, node_of: np.ndarray, c: int, include_recv: bool,
                 max_rounds: int = 1000) -> np.ndarray:
    """Best-improvement pairwise swaps on ``node_of`` (node per new batch; ``v[r, b]``: volume
    source rank r sends to batch b; c ranks per node) for the objective max(per-rank
    inter-node send, and with ``include_recv`` per-batch inter-node receive), ties broken by
    the sum of squares of all those volumes (so plateaus of the max still move). Each round
    takes the swap with the least (max, sum of squares) if it is lexicographically below
    the current one; stops when none is, or after ``max_rounds``. Never worse than the input.
    O(d^2 c) memory and time per round: meant for up to a few hundred ranks."""
    d = v.shape[0]
    nn = d // c
    node_of = np.array(node_of, dtype=np.int64)
    total_send = v.sum(axis=1)
    total_recv = v.sum(axis=0)
    nodecost = v.reshape(nn, c, d).sum(axis=1)  # [node, batch]: volume already on the node
    ranks = np.arange(d).reshape(nn, c)
    pair = np.arange(d)
    for _ in range(max_rounds):
        send = total_send - (v * (node_of[None, :] == (pair // c)[:, None])).sum(axis=1)
        recv = (total_recv - nodecost[node_of, pair]) if include_recv else np.zeros(d)
        cur = max(send.max(), recv.max())
        ss = float((send ** 2).sum() + (recv ** 2).sum())
        rk = ranks[node_of]  # [b, j]: ranks of batch b's node
        # b1's node loses b1 and gains b2: its ranks' sends become s + v[r, b1] - v[r, b2]
        a = (send[rk] + v[rk, pair[:, None]])[:, :, None] - v[rk]  # [b1, j, b2]
        m1 = a.max(axis=1)
        d1 = (a ** 2).sum(axis=1) - (send[rk] ** 2).sum(axis=1)[:, None]  # [b1, b2]
        new_max = np.maximum(m1, m1.T)
        dss = d1 + d1.T
        if include_recv:
            r1 = total_recv[:, None] - nodecost[node_of].T  # [b1, b2]: b1 on b2's node
            new_max = np.maximum(new_max, np.maximum(r1, r1.T))
            dss += r1 ** 2 + r1.T ** 2 - (recv ** 2)[:, None] - (recv ** 2)[None, :]
            ri, rv = _top3(recv)
            new_max = np.maximum(new_max, _max_without(ri[:, None, None], rv[:, None, None],
                                                       pair[:, None], pair[None, :]))
        node_max = send.reshape(nn, c).max(axis=1)
        ni, nv = _top3(node_max)
        n1, n2 = node_of[:, None], node_of[None, :]
        new_max = np.maximum(new_max, _max_without(ni[:, None, None], nv[:, None, None], n1, n2))
        key_max = np.where(n1 != n2, new_max, np.inf)
        best = key_max.min()
        if best > cur:
            break
        cand = key_max == best
        if best == cur:
            cand &= dss < -1e-9 * max(1.0, ss)
            if not cand.any():
                break
        flat = np.flatnonzero(cand)
        b1, b2 = divmod(int(flat[np.argmin(dss.ravel()[flat])]), d)
        node_of[b1], node_of[b2] = node_of[b2], node_of[b1]
    return node_of
