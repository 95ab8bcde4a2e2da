"""grain's `index_shuffle` over an array of indices at once (no JAX): the same Simon-cipher
cycle walk (grain/_src/python/experimental/index_shuffle/index_shuffle.cc: round keys from
C++'s `std::seed_seq{seed}`, a Feistel network of word size W = block size / 2), compiled,
so a global batch's window of 192,000 stream positions is shuffled in about a millisecond
instead of one Python call each (issue 41: host planning linear in the batch). Equal to
grain's on every input (tests/test_shuffle.py)."""
from __future__ import annotations

import math

import numpy as np
from numba import njit

MASK32 = 0xFFFFFFFF


def seed_seq_keys(seed: int, rounds: int) -> np.ndarray:
    """`std::seed_seq{seed}.generate(rk, rk + rounds)` (C++ [rand.util.seedseq])."""
    n, s, v = rounds, 1, [seed & MASK32]
    b = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p = (n - t) // 2
    q = p + t
    m = max(s + 1, n)

    def tx(x: int) -> int:
        return x ^ (x >> 27)
    for k in range(m):
        r1 = (1664525 * tx(b[k % n] ^ b[(k + p) % n] ^ b[(k - 1) % n])) & MASK32
        r2 = (r1 + (s if k == 0 else (k % n + v[k - 1]) if k <= s else k % n)) & MASK32
        b[(k + p) % n] = (b[(k + p) % n] + r1) & MASK32
        b[(k + q) % n] = (b[(k + q) % n] + r2) & MASK32
        b[k % n] = r2
    for k in range(m, m + n):
        r3 = (1566083941 * tx((b[k % n] + b[(k + p) % n] + b[(k - 1) % n]) & MASK32)) & MASK32
        r4 = (r3 - k % n) & MASK32
        b[(k + p) % n] ^= r3
        b[(k + q) % n] ^= r4
        b[k % n] = r4
    return np.asarray(b, np.uint64)


def block_size(max_index: int) -> int:
    """The cipher's block size in bits for [0, max_index] (grain's rule, even, >= 16)."""
    b = int(math.ceil(math.log2(max_index)))
    return min(max(b + b % 2, 16), 64)


@njit(cache=True)
def _rotl(x, r, w, mask):
    return ((x << np.uint64(r)) | (x >> np.uint64(w - r))) & mask


@njit(cache=True)
def _walk(index, max_index, keys, w):
    mask = np.uint64((1 << w) - 1) if w < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)
    out = np.empty(index.size, np.uint64)
    for j in range(index.size):
        x = np.uint64(index[j])
        while True:
            left, right = (x >> np.uint64(w)) & mask, x & mask
            for i in range(0, keys.size, 2):
                left ^= (_rotl(right, 1, w, mask) & _rotl(right, 8, w, mask)) ^ _rotl(
                    right, 2, w, mask)
                left ^= keys[i] & mask
                right ^= (_rotl(left, 1, w, mask) & _rotl(left, 8, w, mask)) ^ _rotl(
                    left, 2, w, mask)
                right ^= keys[i + 1] & mask
            x = (left << np.uint64(w)) | right
            if x <= max_index:
                break
        out[j] = x
    return out


def index_shuffle(index: np.ndarray, max_index: int, seed: int, rounds: int = 4) -> np.ndarray:
    """grain's `index_shuffle(index=i, max_index=max_index, seed=seed, rounds=rounds)` of
    every i in `index` (each in [0, max_index]; rounds even, >= 4) -> int64."""
    index = np.asarray(index, np.int64)
    if max_index == 0:
        return np.zeros(index.size, np.int64)
    if rounds < 4 or rounds % 2:
        raise ValueError(f"rounds={rounds}: use an even number >= 4")
    w = block_size(max_index) // 2
    keys = seed_seq_keys(seed, rounds)
    return _walk(index.astype(np.uint64), np.uint64(max_index), keys, w).astype(np.int64)
