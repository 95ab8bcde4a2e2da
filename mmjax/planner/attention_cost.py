"""Attention work and memory of each `bam_attention` implementation, from tile counts (no JAX).

A tiled kernel pays for whole tiles: a (query block, key block) tile with any allowed pair
costs block_q * block_k pairs, an empty one nothing (`chunked` skips it with a branch,
`pallas` never visits it, cuDNN skips the tiles above the causal diagonal). The dense path
computes every pair of the [S, S] matrix and keeps float32 logits and probabilities of it
for the backward pass; the tiled ones keep only the output and one log-sum-exp per row.
The planner charges 4 * pairs * head_dim FLOPs per head (Q K^T and P V) and these bytes, so
a plan's memory and time follow the implementation it will run, not S^2.

A sliding window (Mistral, Gemma 2/3's local layers: a query sees keys with
idx_q - idx_k < window) shrinks both: the exact count is sum_i min(i + 1, window) pairs, and the
tiled kernels skip tiles wholly outside the window (`chunked`'s branch and `pallas`'s block
map both use each query's window floor; cuDNN's `local_window_size` does the same). The dense
path still computes and keeps the whole [S, S] matrix.

Block shapes mirror models/attention_chunked.py and models/attention_pallas.py (this module
imports no JAX); a sequence shorter than a block shrinks the block as the kernels do.
"""
from __future__ import annotations

BLOCKS = {"chunked": (128, 128), "pallas": (128, 32), "cudnn": (128, 128)}
IMPLS = ("dense",) + tuple(BLOCKS)
DENSE_BYTES_PER_PAIR = 8  # float32 logits + float32 probabilities per (query, key) pair
ROW_BYTES = 4  # float32 log-sum-exp per query row


def _blocks(n: int, impl: str) -> tuple[int, int]:
    bq, bk = BLOCKS[impl]
    if impl == "pallas":  # power-of-two tiles no larger than needed
        p2 = 1 << max(0, (n - 1).bit_length())
        return min(bq, p2), min(bk, p2)
    return min(bq, n), min(bk, n)


def causal_tiles(n: int, bq: int, bk: int) -> int:
    """Non-empty bq x bk tiles of a causal mask over n tokens."""
    nk = -(-n // bk)
    return sum(min(nk, (min((i + 1) * bq, n) - 1) // bk + 1) for i in range(-(-n // bq)))


def window_tiles(n: int, bq: int, bk: int, window: int) -> int:
    """Non-empty bq x bk tiles of a causal mask limited to a sliding window over n tokens:
    a tile's differences idx_q - idx_k form one interval, non-empty iff it meets [0, window)."""
    count = 0
    for i in range(-(-n // bq)):
        q_lo, q_hi = i * bq, min((i + 1) * bq, n) - 1
        for j in range(-(-n // bk)):
            k_lo, k_hi = j * bk, min((j + 1) * bk, n) - 1
            count += q_hi - k_lo >= 0 and q_lo - k_hi <= window - 1
    return count


def exact_pairs(n: int, causal: bool, window: int | None = None) -> int:
    """Allowed (query, key) pairs of one n-token sequence: n^2 bidirectional, n (n + 1) / 2
    causal, sum_i min(i + 1, window) under a sliding window."""
    if not causal:
        return n * n
    if window is None or window >= n:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def image_window_pairs(n: int, side: int) -> int:
    """Pairs of Qwen2.5-VL's window attention over one image of n patches in windows of
    side x side patches (edge windows smaller). The workload keeps patch counts, not grids:
    the image is costed as a square of round(sqrt(n)) rows (an estimate; exact for square
    grids), pairs = P(rows) * P(cols) with P(x) = (x // side) side^2 + (x % side)^2."""
    if n <= 0:
        return 0
    rows = max(1, round(n ** 0.5))
    cols = -(-n // rows)
    p = lambda x: (x // side) * side * side + (x % side) ** 2
    return min(n * n, p(rows) * p(cols))


def full_tiles(n: int, bq: int, bk: int) -> int:
    """Tiles of a bidirectional n-token segment (all non-empty)."""
    return -(-n // bq) * -(-n // bk)


def computed_pairs(n: int, impl: str, causal: bool, window: int | None = None) -> int:
    """(query, key) pairs the implementation computes for one n-token sequence; `window`:
    the layer's sliding window (causal only; None: none)."""
    if impl not in IMPLS:
        raise ValueError(f"error: attention_impl={impl!r} is unknown (use one of {list(IMPLS)})")
    if n <= 0:
        return 0
    if impl == "dense":
        return n * n
    bq, bk = _blocks(n, impl)
    if not causal:
        tiles = full_tiles(n, bq, bk)
    elif window is not None and window < n:
        tiles = window_tiles(n, bq, bk, window)
    else:
        tiles = causal_tiles(n, bq, bk)
    return tiles * bq * bk


def kept_bytes_per_head(n: int, impl: str) -> int:
    """Attention bytes one head keeps for the backward pass beyond its output."""
    return DENSE_BYTES_PER_PAIR * n * n if impl == "dense" else ROW_BYTES * n
