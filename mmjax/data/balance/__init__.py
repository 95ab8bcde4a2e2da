"""OrchMLLM batch post-balancing (OrchMLLM §5) and rearrangement composition (§6).

* ``post_balance(lengths, num_ranks, policy)``: rearrange the examples of all DP instances'
  mini-batches into ``num_ranks`` new mini-batches minimising the largest cost (§5.1, Eq. 1-2):
  "sum" (Algorithm 1), "padded" (Algorithm 2), "sum_square" (Appendix A, Algorithm 4),
  "conv" (Appendix A, Algorithm 5). ``batch_cost`` is the matching per-batch cost.
* ``node_wise_rearrange``: Algorithm 3 (§5.2.2), permute the new mini-batches over ranks so the
  largest per-rank inter-node all-to-all volume (Eq. 5) is minimal; ``inter_node_volumes``
  measures it.
* ``Rearrangement`` / ``compose_rearrangement``: where every example moves, (rank, slot) ->
  (rank, slot); per encoder the single map Pi_M o Pi_E^-1 from the encoder's balanced batches
  to the LLM rank that consumes its output (§6, "Rearrangement composition").

Files: lpt.py (Algorithm 1 and the shared pieces; lpt_int.py compiled on token counts),
padded.py, sum_square.py (+ sum_square_int.py), conv.py,
node_wise.py (+ node_swaps.py, and data/node_milp.py for the MILP), rearrangement.py; every
public name imports from here. ``post_balance_flat`` is ``post_balance`` as arrays.

Pure host code (numpy, numba, highspy); no JAX. Every host runs it on the all-gathered lengths and gets
the same answer (§5.2.1), so all algorithms are deterministic: ties go to the lower index.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from mmjax.data.balance.conv import _conv
from mmjax.data.balance.lpt import _as_lengths, _check_ranks, _greedy, _lists, greedy_partition
from mmjax.data.balance.node_wise import (batches_by_rank, inter_node_volumes,
                                          max_inter_node_volume, node_wise_rearrange,
                                          node_wise_rearrange_flat, volume_matrix)
from mmjax.data.balance.padded import _padded
from mmjax.data.balance.rearrangement import (Rearrangement, compose_rearrangement,
                                              rearrangement)
from mmjax.data.balance.sum_square import _sum_square_flat

POLICIES = ("sum", "padded", "sum_square", "conv")

__all__ = ["POLICIES", "Rearrangement", "batch_cost", "batches_by_rank", "compose_rearrangement",
           "greedy_partition", "inter_node_volumes", "max_inter_node_volume",
           "node_wise_rearrange", "node_wise_rearrange_flat", "post_balance", "post_balance_flat", "rearrangement",
           "volume_matrix"]


def post_balance(lengths: Sequence[float], num_ranks: int, policy: str = "sum", *,
                 tolerance: float | None = None) -> list[list[int]]:
    """Batch post-balancing (OrchMLLM §5.1 and Appendix A): sample indices per new mini-batch.

    ``lengths``: per-sample length in tokens for one phase (an encoder's input tokens, or the
    whole interleaved sequence for the LLM, §6 "Subsequences assembly"). ``policy``:
    "sum" (no padding, Algorithm 1, LPT, 4/3-approximate), "padded" (padding, cost
    count * max, Algorithm 2, binary search + greedy), "sum_square" (no padding with a
    non-negligible attention term, Algorithm 4; ``tolerance`` in tokens, default the mean
    length; 0 gives Algorithm 1), "conv" (padded attention, Algorithm 5).
    Returns exactly ``num_ranks`` lists (some may be empty); every sample appears once.
    Leave out samples that have no data for the phase (length 0): an encoder's dispatcher
    only sees samples with its modality, and zero lengths all land on one lightest batch.
    """
    return _lists(*post_balance_flat(lengths, num_ranks, policy, tolerance=tolerance))


def post_balance_flat(lengths: Sequence[float] | np.ndarray, num_ranks: int, policy: str = "sum", *,
                      tolerance: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`post_balance` as arrays: (sample indices batch after batch, count per batch), the
    same batches in the same order. Skips building ``num_ranks`` Python lists (at 2560
    ranks x 60 samples that alone costs more than the balancing)."""
    _check_ranks(num_ranks)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    x = _as_lengths(lengths, "lengths")
    d = int(num_ranks)
    if x.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(d, dtype=np.int64)
    if policy == "sum":
        return _greedy(x, d)
    if policy == "padded":
        return _padded(x, d)
    if policy == "sum_square":
        tol = float(x.mean()) if tolerance is None else float(tolerance)
        if not math.isfinite(tol) or tol < 0:
            raise ValueError(f"tolerance must be finite and >= 0 tokens, got {tolerance!r}")
        return _sum_square_flat(x, d, tol)
    return _conv(x, d)


def batch_cost(batch_lengths: Sequence[float], policy: str = "sum", lam: float = 0.0) -> float:
    """Cost of one mini-batch (OrchMLLM Eq. 1-2, Appendix A), in units of alpha.

    "sum": sum l; "padded": count * max l; "sum_square": sum l + lam * sum l^2;
    "conv": sum l + lam * count * (max l)^2, with lam = beta / alpha.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    x = _as_lengths(batch_lengths, "batch_lengths")
    if x.size == 0:
        return 0.0
    if policy == "sum":
        return float(x.sum())
    if policy == "padded":
        return float(x.size * x.max())
    if policy == "sum_square":
        return float(x.sum() + lam * (x * x).sum())
    return float(x.sum() + lam * x.size * x.max() ** 2)
