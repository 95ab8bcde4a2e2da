"""`np.random.default_rng([seed, index, k])`'s PCG64 state for many indices at once (no
JAX): NumPy's `SeedSequence` hash (numpy/random/bit_generator.pyx: `mix_entropy`,
`generate_state`) over uint32 arrays and PCG64's `set_seed` (two 128-bit LCG steps),
so the synthetic source draws a sample's shapes from a reused generator whose state is
set, not one built per sample (two thirds of `laion_spec`'s time; issue 41: `--check`
at global_batch=100000). Equal to NumPy's on every input (tests/test_seed_states.py)."""
from __future__ import annotations

import numpy as np

INIT_A, MULT_A, INIT_B, MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
MIX_MULT_L, MIX_MULT_R, XSHIFT, POOL = 0xCA01F9DD, 0x4973F715, 16, 4
PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
M128 = (1 << 128) - 1


def _words(x: int) -> list[int]:
    """NumPy's uint32 words of a non-negative int (little end first; 0 is one word)."""
    out = [x & 0xFFFFFFFF]
    x >>= 32
    while x:
        out.append(x & 0xFFFFFFFF)
        x >>= 32
    return out


class _Hash:
    """`hashmix` with its running constant, over uint32 arrays."""

    def __init__(self, init: int):
        self.const = np.uint32(init)

    def __call__(self, value: np.ndarray) -> np.ndarray:
        value = value ^ self.const
        self.const = np.uint32((int(self.const) * MULT_A) & 0xFFFFFFFF)
        value = value * self.const
        return value ^ (value >> np.uint32(XSHIFT))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r: np.ndarray = np.uint32(MIX_MULT_L) * x - np.uint32(MIX_MULT_R) * y
    return r ^ (r >> np.uint32(XSHIFT))


def seed_states(seed: int, indices: np.ndarray, k: int) -> np.ndarray:
    """`SeedSequence([seed, i, k]).generate_state(4, np.uint64)` of each i in `indices`
    (non-negative, < 2**32) -> uint64 [n, 4]."""
    idx = np.asarray(indices, np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= 1 << 32):
        raise ValueError("indices must lie in [0, 2**32)")
    n = idx.size
    with np.errstate(over="ignore"):
        entropy = ([np.full(n, w, np.uint32) for w in _words(seed)] + [idx.astype(np.uint32)]
                   + [np.full(n, w, np.uint32) for w in _words(k)])
        h = _Hash(INIT_A)
        pool = [h(entropy[i] if i < len(entropy) else np.zeros(n, np.uint32))
                for i in range(POOL)]
        for src in range(POOL):
            for dst in range(POOL):
                if src != dst:
                    pool[dst] = _mix(pool[dst], h(pool[src]))
        for src in range(POOL, len(entropy)):
            for dst in range(POOL):
                pool[dst] = _mix(pool[dst], h(entropy[src]))
        const, out = INIT_B, []
        for i in range(8):
            v = pool[i % POOL] ^ np.uint32(const)
            const = (const * MULT_B) & 0xFFFFFFFF
            v = v * np.uint32(const)
            out.append(v ^ (v >> np.uint32(XSHIFT)))
    return np.ascontiguousarray(np.stack(out, 1)).view(np.uint64)


def pcg64_state(words) -> dict:
    """PCG64's `state` dict after seeding from the 4 uint64 `words` (`pcg64_set_seed`)."""
    w = [int(x) for x in words]
    init, seq = (w[0] << 64) | w[1], (w[2] << 64) | w[3]
    inc = ((seq << 1) | 1) & M128
    state = inc  # state 0, one step
    state = ((state + init) * PCG_MULT + inc) & M128
    return {"bit_generator": "PCG64", "state": {"state": state, "inc": inc},
            "has_uint32": 0, "uinteger": 0}
