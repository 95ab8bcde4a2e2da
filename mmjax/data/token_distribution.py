"""Multimodality-aware token distribution for context parallelism (Cornstarch §4.3.2, §5.3, App. A).

A context-parallel (CP) group of G ranks splits one sequence's query tokens; every rank then
attends its queries against all (all-gathered) keys (§5.3). Under a multimodal Bitfield
Attention Mask (BAM, §4.3.1) the attention work per query differs wildly between tokens, so
an equal token count is not an equal workload (§2.3.2, C4). This module assigns contiguous
*blocks* of `block_size` query tokens to ranks:

  uniform  G contiguous chunks of blocks (naive ring attention's split),
  zigzag   2G chunks, rank i gets chunks i and 2G-1-i (balanced only for causal masks, §2.3.2),
  lpt      Longest-Processing-Time-first greedy on per-block work (§4.3.2, Appendix A Alg. 2),
  random   a seeded random permutation of blocks dealt in equal shares (§5.3).

Work is counted at the attention kernel's tile granularity: a (query block, key block) tile of
block_size x key_block tokens that holds at least one allowed pair costs block_size * key_block
pairs and an empty tile costs nothing, as in a block-sparse kernel (FlexAttention in
Cornstarch, `mmjax/models/attention_pallas.py` here) that skips empty tiles; the key block
defaults to the Pallas kernel's (DEFAULT_KEY_BLOCK), and `token_cost` adds a per-token linear
term (work that scales with a block's real tokens, not its pairs). From a `BitfieldMask` the work is computed
piece by piece (runs of equal metadata split at block boundaries), never materialising S x S.

No JAX here: the distribution is planned on the host from metadata only.
"""
from __future__ import annotations

import heapq
from typing import Any

import numpy as np

METHODS = ("uniform", "zigzag", "lpt", "random")
DEFAULT_KEY_BLOCK = 32  # = models/attention_pallas.py BLOCK_K (no JAX here); Cornstarch's 128 x 32
FAMILIES = ("causal", "prepended", "embedded", "packing")
_FAMILY_ALIASES = {"ep": "prepended", "ee": "embedded", "mp": "packing"}


class BitfieldMask:
    """Per-token BAM metadata of one row (Cornstarch §4.3.1); the rule is `allowed` below.

    bam: int64 bitfield (bit 0 = text, bit i+1 = modality i, 0 = padding); doc: 1-based packed
    document id (0 = padding); sub: 1-based modality-subsequence id, unique per image/clip in
    the row (0 for text and padding). A token's global index is its position in the row.
    Built once from any integer sequences (checked, converted); read-only by convention.
    """

    __slots__ = ("bam", "doc", "sub")

    def __init__(self, bam, doc, sub):
        arrays = {}
        for name, dtype, value in (("bam", np.int64, bam), ("doc", np.int32, doc),
                                   ("sub", np.int32, sub)):
            a = np.asarray(value)
            if a.ndim != 1:
                raise ValueError(f"BitfieldMask.{name} must be 1-D (one row), got shape {a.shape}")
            if not np.issubdtype(a.dtype, np.integer):
                raise ValueError(f"BitfieldMask.{name} must hold integers, got dtype {a.dtype}")
            if a.size and a.min() < 0:
                raise ValueError(f"BitfieldMask.{name} must be non-negative")
            arrays[name] = a.astype(dtype)
        if not arrays["bam"].shape == arrays["doc"].shape == arrays["sub"].shape:
            raise ValueError("BitfieldMask.bam, .doc and .sub must have the same length, got "
                             f"{arrays['bam'].shape}, {arrays['doc'].shape}, {arrays['sub'].shape}")
        self.bam, self.doc, self.sub = arrays["bam"], arrays["doc"], arrays["sub"]

    @property
    def seq_len(self) -> int:
        return int(self.bam.shape[0])

    def dense(self) -> np.ndarray:
        """The full (S, S) boolean mask; only for short rows (tests, small examples)."""
        idx = np.arange(self.seq_len)
        return allowed(self.bam, self.bam, idx, idx, self.doc, self.doc, self.sub, self.sub)


def allowed(bam_q, bam_k, idx_q, idx_k, doc_q, doc_k, sub_q, sub_k) -> np.ndarray:
    """Host (numpy) twin of mmjax.models.attention.allowed_mask: bool [..., Sq, Sk]."""
    q = lambda a: np.asarray(a)[..., :, None]
    k = lambda a: np.asarray(a)[..., None, :]
    same_doc = (q(doc_q) == k(doc_k)) & (q(doc_q) != 0)
    q_text = (q(bam_q) & 1) != 0
    text_rule = q_text & ((q(bam_q) & k(bam_k)) != 0) & (k(idx_k) <= q(idx_q))
    mod_rule = ~q_text & (q(sub_q) == k(sub_k)) & (q(sub_q) != 0)
    return same_doc & (text_rule | mod_rule)


def num_blocks(seq_len: int, block_size: int) -> int:
    """Blocks after padding the sequence to block alignment."""
    return -(-seq_len // block_size)


def _seq_len(mask) -> int:
    if isinstance(mask, BitfieldMask):
        return mask.seq_len
    m = np.asarray(mask)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or m.dtype != np.bool_:
        raise ValueError(f"mask must be a BitfieldMask or a square boolean (S, S) array, "
                         f"got dtype {m.dtype} shape {m.shape}")
    return int(m.shape[0])


def _check_block_size(block_size) -> int:
    if int(block_size) != block_size or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    return int(block_size)


def block_work(mask, block_size: int = 128, key_block: int | None = None,
               token_cost: float = 0.0) -> np.ndarray:
    """Attention work per query block: block_size * key_block times its non-empty tiles
    (key_block None: square block_size tiles), plus token_cost per real query token.

    Returns int64 [num_blocks] (float64 when token_cost != 0). Padding to block alignment adds
    no allowed pairs. With block_size = key_block = 1 this is the row sum of the mask, the W_i
    of the ILP in Cornstarch §4.3.2.
    """
    block_size = _check_block_size(block_size)
    key_block = block_size if key_block is None else _check_block_size(key_block)
    seq_len = _seq_len(mask)
    if isinstance(mask, BitfieldMask):
        tiles = _tiles_from_bitfield(mask, block_size, key_block)
    else:
        nb, nk = num_blocks(seq_len, block_size), num_blocks(seq_len, key_block)
        padded = np.zeros((nb * block_size, nk * key_block), dtype=bool)
        padded[:seq_len, :seq_len] = mask
        tiles = padded.reshape(nb, block_size, nk, key_block).any(axis=(1, 3)).sum(axis=1)
    work = tiles.astype(np.int64) * block_size * key_block
    if token_cost == 0:
        return work
    return work + float(token_cost) * _real_tokens(mask, block_size)


def _real_tokens(mask, block_size: int) -> np.ndarray:
    """Tokens per query block that are not padding (doc != 0, or a non-empty mask row)."""
    seq_len = _seq_len(mask)
    real = (mask.doc != 0) if isinstance(mask, BitfieldMask) else np.asarray(mask).any(axis=1)
    padded = np.zeros(num_blocks(seq_len, block_size) * block_size, np.float64)
    padded[:seq_len] = real
    return padded.reshape(-1, block_size).sum(axis=1)


def _pieces(mask: BitfieldMask, block_size: int):
    """Runs of equal (bam, doc, sub) split at block boundaries, padding dropped:
    (start, end, bam, doc, sub, block) arrays."""
    s = mask.seq_len
    idx = np.arange(s)
    change = np.ones(s, dtype=bool)
    change[1:] = ((mask.bam[1:] != mask.bam[:-1]) | (mask.doc[1:] != mask.doc[:-1])
                  | (mask.sub[1:] != mask.sub[:-1]) | (idx[1:] % block_size == 0))
    start = np.flatnonzero(change)
    end = np.append(start[1:], s) - 1
    bam, doc, sub = mask.bam[start], mask.doc[start], mask.sub[start]
    real = doc != 0
    return tuple(a[real] for a in (start, end, bam, doc, sub, start // block_size))


def _tiles_from_bitfield(mask: BitfieldMask, block_size: int, key_block: int) -> np.ndarray:
    """Non-empty key tiles per query block, from runs of equal metadata ("pieces").

    A piece is a maximal run of tokens with equal (bam, doc, sub) inside one block (query
    pieces split at query blocks, key pieces at key blocks). A text
    query piece P (doc d, bits b) covers the key blocks holding a piece of doc d that shares
    a bit with b and starts at or before P's end (some key precedes some query); those
    blocks, in order of their first such piece, form a list whose covered prefix is found by
    one binary search. A modality piece covers the blocks of its (doc, subsequence). A block
    with one piece (the common case) needs only that count, vectorised per (d, b); blocks
    with several pieces take the union. Memory and time are O(pieces), never O(S^2).
    """
    s = mask.seq_len
    nb = num_blocks(s, block_size)
    tiles = np.zeros(nb, np.int64)
    if s == 0:
        return tiles
    start, end, bam, doc, sub, block = _pieces(mask, block_size)
    if start.size == 0:
        return tiles
    k_pieces = _pieces(mask, key_block) if key_block != block_size else (
        start, end, bam, doc, sub, block)
    kstart, _, kbam, kdoc, ksub, kblock = k_pieces
    text = (bam & 1) != 0
    alone = np.bincount(block, minlength=nb)[block] == 1

    # Text patterns (doc, bits): distinct key blocks with their first covering start.
    covers: dict[tuple, Any] = {}  # text: (starts, blocks); modality: blocks
    patterns, which = np.unique(np.stack([doc[text], bam[text]], axis=1), axis=0,
                                return_inverse=True)
    which = which.reshape(-1)
    text_ids = np.flatnonzero(text)
    for i, (d, b) in enumerate(patterns.tolist()):
        sel = np.flatnonzero((kdoc == d) & ((kbam & b) != 0))  # in sequence order
        k_start, k_block = kstart[sel], kblock[sel]
        first = np.ones(sel.size, dtype=bool)
        first[1:] = k_block[1:] != k_block[:-1]
        fs, fb = k_start[first], k_block[first]
        covers[("t", d, b)] = (fs, fb)
        q = text_ids[which == i]
        q = q[alone[q]]
        tiles[block[q]] = np.searchsorted(fs, end[q], side="right")

    # Modality subsequences (doc, sub): the blocks holding them.
    mod_ids = np.flatnonzero(~text & (sub != 0))
    for p in mod_ids:
        key = ("m", int(doc[p]), int(sub[p]))
        if key not in covers:
            covers[key] = np.unique(kblock[(kdoc == doc[p]) & (ksub == sub[p])])
        if alone[p]:
            tiles[block[p]] = covers[key].size

    # Blocks with several pieces: union of what each piece covers.
    marks = np.zeros(num_blocks(s, key_block), dtype=bool)
    shared = np.flatnonzero(~alone)
    for qb, group in zip(*_runs(block[shared], shared)):
        for p in group:
            if text[p]:
                fs, fb = covers[("t", int(doc[p]), int(bam[p]))]
                marks[fb[:np.searchsorted(fs, end[p], side="right")]] = True
            elif sub[p] != 0:
                marks[covers[("m", int(doc[p]), int(sub[p]))]] = True
        tiles[qb] = marks.sum()
        marks[:] = False
    return tiles


def _runs(keys: np.ndarray, values: np.ndarray):
    """Split `values` into runs of equal consecutive `keys`: (run keys, list of value arrays)."""
    if keys.size == 0:
        return [], []
    cuts = np.flatnonzero(np.diff(keys)) + 1
    return keys[np.r_[0, cuts]].tolist(), np.split(values, cuts)


def lpt(work: np.ndarray, num_ranks: int, capacity: int | None = None) -> np.ndarray:
    """Greedy Longest-Processing-Time-first makespan minimisation (Cornstarch Appendix A, Alg. 2).

    Blocks sorted by descending work (ties: lower block first) each go to the currently
    least-loaded rank (ties: lower rank). With `capacity`, a rank holding that many blocks
    takes no more (so every rank fits a static length of capacity blocks; jit needs static
    shapes). Returns the rank of every block, int32.
    """
    work = np.asarray(work, dtype=np.int64)
    if work.ndim != 1 or (work.size and work.min() < 0):
        raise ValueError("work must be a 1-D array of non-negative integers")
    if capacity is not None and capacity * num_ranks < work.size:
        raise ValueError(f"capacity={capacity} blocks per rank cannot hold {work.size} blocks "
                         f"on {num_ranks} ranks; use capacity >= {-(-work.size // num_ranks)}")
    order = np.argsort(-work, kind="stable")
    # Heap of single ints key = load * G + rank: orders like (load, rank), so the pop gives
    # the least-loaded rank with ties to the lower rank, and adding w * G keeps the rank.
    heap = list(range(num_ranks))
    picked: list[int] = []
    pick, replace = picked.append, heapq.heapreplace
    if capacity is None:
        for w in (work[order] * num_ranks).tolist():
            key = heap[0]
            pick(key)
            replace(heap, key + w)
    else:
        counts = [0] * num_ranks
        for w in (work[order] * num_ranks).tolist():
            key = heap[0]
            pick(key)
            r = key % num_ranks
            counts[r] += 1
            if counts[r] == capacity:
                heapq.heappop(heap)
            else:
                replace(heap, key + w)
    assignment = np.empty(work.shape[0], np.int32)
    assignment[order] = np.asarray(picked, dtype=np.int64) % num_ranks
    return assignment


def ilp(work: np.ndarray, num_ranks: int, time_limit: float = 10.0) -> tuple[np.ndarray, bool]:
    """Makespan-minimising assignment by the ILP of Cornstarch §4.3.2 Eq. (1), via cvxpy/HiGHS.

    minimise C s.t. every block on exactly one rank and each rank's work <= C. Too slow for
    training-time use (hence LPT); here it measures how far LPT is from optimal. Returns
    (rank of every block, whether the solver proved optimality within `time_limit` s).
    """
    import cvxpy as cp  # heavy import, needed only for this reference solver

    work = np.asarray(work, dtype=np.int64)
    if work.ndim != 1 or work.size == 0:
        raise ValueError("work must be a non-empty 1-D array")
    scale = int(np.gcd.reduce(work)) or 1
    x = cp.Variable((work.size, num_ranks), boolean=True)
    c = cp.Variable()
    problem = cp.Problem(cp.Minimize(c), [cp.sum(x, axis=1) == 1, (work // scale) @ x <= c])
    problem.solve(solver=cp.HIGHS, time_limit=time_limit)
    if x.value is None:
        raise RuntimeError(f"ILP found no assignment within time_limit={time_limit}s; "
                           "raise time_limit or use lpt")
    return x.value.argmax(axis=1).astype(np.int32), problem.status == cp.OPTIMAL


def assign_blocks(nblocks: int, num_ranks: int, method: str, work=None, seed: int = 0,
                  capacity: int | None = None):
    """Rank of each of `nblocks` blocks, int32 [nblocks]; `work` and `capacity` are for "lpt".

    uniform, zigzag and random never give a rank more than ceil(nblocks / G) blocks.
    """
    if method == "uniform":
        chunks = np.array_split(np.arange(nblocks), num_ranks)
        owner = np.arange(num_ranks)
    elif method == "zigzag":
        chunks = np.array_split(np.arange(nblocks), 2 * num_ranks)
        owner = np.concatenate([np.arange(num_ranks), np.arange(num_ranks)[::-1]])
    elif method == "random":
        perm = np.random.default_rng(seed).permutation(nblocks)
        chunks = np.array_split(perm, num_ranks)
        owner = np.arange(num_ranks)
    elif method == "lpt":
        if work is None or len(work) != nblocks:
            raise ValueError(f"lpt needs the work of all {nblocks} blocks")
        return lpt(work, num_ranks, capacity)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    assignment = np.empty(nblocks, np.int32)
    for r, chunk in zip(owner, chunks):
        assignment[chunk] = r
    return assignment


def distribute(mask, num_ranks: int, method: str, block_size: int = 128,
               seed: int = 0, *, capacity: int | None = None,
               key_block: int | None = DEFAULT_KEY_BLOCK,
               token_cost: float = 0.0) -> list[np.ndarray]:
    """Sorted global token indices of every CP rank (Cornstarch §4.3.2, §5.3).

    mask: a `BitfieldMask` or a dense boolean (S, S) array, allowed[q, k]. The sequence is
    padded to block alignment; padding tokens (index >= S) are not returned. Deterministic
    for a given (mask, num_ranks, method, block_size, seed). capacity: optional cap on
    blocks per rank for "lpt" (see `lpt`); the plain Appendix A algorithm when None.
    LPT weighs a query block by `block_work(mask, block_size, key_block, token_cost)`: its
    non-empty block_size x key_block tiles (the attention kernel's, DEFAULT_KEY_BLOCK; None
    for square tiles) plus token_cost per real token.
    """
    if int(num_ranks) != num_ranks or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks!r}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    block_size = _check_block_size(block_size)
    seq_len = _seq_len(mask)
    nb = num_blocks(seq_len, block_size)
    work = block_work(mask, block_size, key_block, token_cost) if method == "lpt" else None
    assignment = assign_blocks(nb, int(num_ranks), method, work=work, seed=seed,
                               capacity=capacity)
    token_rank = np.repeat(assignment, block_size)[:seq_len]
    return [np.flatnonzero(token_rank == r) for r in range(int(num_ranks))]


def check_distribution(dist, seq_len: int) -> None:
    """Raise ValueError unless `dist` holds every token of [0, seq_len) exactly once, sorted."""
    for r, ids in enumerate(dist):
        ids = np.asarray(ids)
        if ids.ndim != 1 or (ids.size > 1 and np.any(np.diff(ids) <= 0)):
            raise ValueError(f"rank {r}: indices must be a strictly increasing 1-D array")
    allids = np.concatenate([np.asarray(d, np.int64) for d in dist]) if dist else np.zeros(0)
    if allids.size != seq_len or not np.array_equal(np.sort(allids), np.arange(seq_len)):
        raise ValueError(f"distribution must cover tokens 0..{seq_len - 1} exactly once")


def rank_work(work: np.ndarray, dist, block_size: int) -> np.ndarray:
    """Work per rank, int64 [G]: the sum of `work` over the query blocks each rank holds."""
    work = np.asarray(work)
    return np.array([work[np.unique(np.asarray(ids) // block_size)].sum() if len(ids) else 0
                     for ids in dist], dtype=np.int64)


def work_stats(work: np.ndarray, dist, block_size: int) -> dict:
    """Per-rank work summary: max (the makespan), mean, and imbalance max/mean."""
    per_rank = rank_work(work, dist, block_size)
    mean = float(per_rank.mean())
    return {"per_rank": per_rank.tolist(), "max": int(per_rank.max()), "mean": mean,
            "imbalance": float(per_rank.max() / mean) if mean > 0 else 1.0}


def static_length(dists, block_size: int = 1) -> int:
    """Smallest per-rank length, rounded up to `block_size`, that fits every rank of every row."""
    longest = max((len(ids) for dist in dists for ids in dist), default=0)
    return max(block_size, -(-longest // block_size) * block_size)


def layout_indices(dist, seq_len: int, length: int | None = None) -> np.ndarray:
    """Gather indices of the CP layout, int32 [G * length], rank-major.

    Rank r's slice [r*length, (r+1)*length) holds its sorted token indices, then the
    sentinel `seq_len` (a padding token: doc 0, attends nothing, attended by nothing) up to
    the static `length` (default: the longest rank). Sharding this axis over the 'cp' mesh
    axis gives every rank exactly its tokens.
    """
    longest = max((len(ids) for ids in dist), default=0)
    length = longest if length is None else int(length)
    if length < longest:
        raise ValueError(f"length={length} is shorter than the longest rank ({longest} tokens); "
                         "pass length >= static_length(dists)")
    out = np.full((len(dist), length), seq_len, dtype=np.int32)
    for r, ids in enumerate(dist):
        out[r, :len(ids)] = ids
    return out.reshape(-1)


def batch_layout(bam, doc, sub, num_ranks: int, method: str, block_size: int = 128,
                 seed: int = 0, key_block: int | None = DEFAULT_KEY_BLOCK,
                 token_cost: float = 0.0) -> np.ndarray:
    """CP gather indices for a batch of rows [B, S] of BAM metadata: int32 [B, G * L].

    Each row gets its own distribution. LPT is capped at ceil(blocks / G) blocks per rank,
    so every method and every batch of this S has the same static L = ceil(blocks / G) *
    block_size (one compilation); `mmjax.parallel.context.to_cp_layout` applies the result.
    key_block / token_cost: LPT's work model (see `distribute`).
    """
    bam, doc, sub = (np.asarray(a) for a in (bam, doc, sub))
    if bam.ndim != 2 or bam.shape != doc.shape or bam.shape != sub.shape:
        raise ValueError(f"bam, doc and sub must all be [B, S], got {bam.shape}, {doc.shape}, "
                         f"{sub.shape}")
    seq_len = bam.shape[1]
    cap = -(-num_blocks(seq_len, _check_block_size(block_size)) // num_ranks)
    rows = [distribute(BitfieldMask(bam=b, doc=d, sub=s), num_ranks, method, block_size,
                       seed=seed + i, capacity=cap, key_block=key_block, token_cost=token_cost)
            for i, (b, d, s) in enumerate(zip(bam, doc, sub))]
    return np.stack([layout_indices(r, seq_len, cap * block_size) for r in rows])


def example_mask(family: str, seq_len: int, seed: int = 0,
                 num_modalities: int = 2) -> BitfieldMask:
    """Random BAM rows of the mask families of Cornstarch Fig. 11, plus plain causal.

    causal: one text document. prepended (EP): modality clips first, then text that sees
    them. embedded (EE): clips embedded between text runs. packing (MP): several documents,
    each prepended or embedded, packed into one row and followed by some padding.
    """
    family = _FAMILY_ALIASES.get(family, family)
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES} (or ep/ee/mp), got {family!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    if not 1 <= num_modalities <= 30:
        raise ValueError(f"num_modalities must be in 1..30, got {num_modalities}")
    rng = np.random.default_rng(seed)
    bam = np.zeros(seq_len, np.int64)
    doc = np.zeros(seq_len, np.int32)
    sub = np.zeros(seq_len, np.int32)
    next_sub = [1]

    def fill(lo, hi, kind, doc_id):
        n = hi - lo
        doc[lo:hi] = doc_id
        if kind == "causal" or n < 4:
            bam[lo:hi] = 1
            return
        n_clips = int(rng.integers(1, 4)) if kind == "prepended" else int(rng.integers(2, 6))
        sizes = rng.integers(max(1, n // 16), max(2, n // (2 * n_clips)) + 1, size=n_clips)
        sizes = sizes[np.cumsum(sizes) <= n - 1]  # keep at least one text token
        text = n - int(sizes.sum())
        if kind == "prepended":
            gaps = np.zeros(sizes.size + 1, np.int64)
            gaps[-1] = text
        else:
            cuts = np.sort(rng.integers(0, text + 1, size=sizes.size))
            gaps = np.diff(np.concatenate([[0], cuts, [text]]))
        modalities = rng.integers(0, num_modalities, size=sizes.size)
        text_bits = 1
        for m in modalities:
            text_bits |= 1 << (int(m) + 1)
        pos = lo
        for i in range(sizes.size + 1):
            bam[pos:pos + gaps[i]] = text_bits
            pos += int(gaps[i])
            if i < sizes.size:
                bam[pos:pos + sizes[i]] = 1 << (int(modalities[i]) + 1)
                sub[pos:pos + sizes[i]] = next_sub[0]
                next_sub[0] += 1
                pos += int(sizes[i])

    if family != "packing":
        fill(0, seq_len, family, 1)
    else:
        used = seq_len - int(rng.integers(0, max(1, seq_len // 16)))
        n_docs = int(rng.integers(3, 7))
        cuts = np.sort(rng.choice(np.arange(1, used), size=min(n_docs - 1, used - 1),
                                  replace=False)) if used > 1 else np.zeros(0, np.int64)
        edges = np.concatenate([[0], cuts, [used]]).astype(np.int64)
        for d in range(edges.size - 1):
            kind = "prepended" if rng.random() < 0.5 else "embedded"
            fill(int(edges[d]), int(edges[d + 1]), kind, d + 1)
    return BitfieldMask(bam=bam, doc=doc, sub=sub)
