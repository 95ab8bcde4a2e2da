"""The LLM's split by whole packed rows (`Loader.balance = {"llm": "rows"}`, no JAX): the
microbatch's samples are packed first fit decreasing into rows over the whole microbatch
(`batch_shapes.pack_rows`, as one rank would pack them), then the rows are dealt to the DP
ranks, each rank taking floor or ceil of rows / dp, heaviest row first to the rank with the
least work of those with room (LPT, the same greedy as OrchMLLM Algorithm 1, on rows).

A sample-wise balancer (OrchMLLM §5.1) equalises tokens per rank, so each rank's share
rounds up to whole rows on its own (8 LLaVA-like samples of ~1.1k tokens are 2.2 rows of
4096: 3 rows, bucketed to 4): the step's shape is the fullest rank's rows. Dealt rows keep
the single rank's packing, so a microbatch whose rows are a multiple of dp (a
`Loader.row_budget` of dp x a bucket size, one microbatch) fills like one rank
(docs/packing.md)."""
from __future__ import annotations

import heapq

import numpy as np

from mmjax.data.batch_shapes import pack_rows
from mmjax.data.rank_split import RankSplit


def deal_rows(lengths: np.ndarray, dp: int, seq_len: int,
              work: np.ndarray | None = None) -> RankSplit:
    """Rank split of samples with LLM `lengths` (one microbatch) over `dp` ranks by whole
    first-fit-decreasing rows of `seq_len`; `work` per sample (default its length) is what
    the dealing balances among ranks of equal row counts. A rank's samples in batch order."""
    lengths = np.asarray(lengths, np.int64)
    n = lengths.size
    if n == 0:
        return RankSplit(np.zeros(0, np.int64), np.zeros(dp, np.int64))
    row_of = np.asarray(pack_rows(lengths.tolist(), seq_len, "pack"), np.int64)
    rows = int(row_of.max()) + 1
    w = lengths if work is None else np.asarray(work, np.float64)
    row_work = np.bincount(row_of, weights=w, minlength=rows)
    cap = -(-rows // dp)  # rows a rank may take
    rank_of_row = np.empty(rows, np.int64)
    heap = [(0.0, r) for r in range(dp)]  # (work so far, rank) of ranks with room
    taken = np.zeros(dp, np.int64)
    for row in sorted(range(rows), key=lambda j: (-row_work[j], j)):
        load, r = heapq.heappop(heap)
        rank_of_row[row] = r
        taken[r] += 1
        if taken[r] < cap:
            heapq.heappush(heap, (load + float(row_work[row]), r))
    rank = rank_of_row[row_of]
    items = np.argsort(rank, kind="stable")  # rank after rank, batch order within a rank
    return RankSplit(items.astype(np.int64), np.bincount(rank, minlength=dp).astype(np.int64))
