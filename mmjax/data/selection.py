"""A global batch's samples picked from the seeded stream over arrays (no JAX): the same
choice as one candidate at a time (`GlobalBatchBuilder.select`'s rule: the first
`global_batch` usable candidates of the window, then of the replacement stream; each
dataset index at most once; with a row budget the whole window and then replacements
until enough), taken in chunks: a chunk's stream positions shuffled at once
(data/shuffle.py), its shapes read at once (a source's `spec_table()`, else its
`specs` or `spec` per index), checked at once (`SpecColumns.usable`); only the unusable ones go
through the per-sample check for their reason (issue 41: host planning linear in the
batch)."""
from __future__ import annotations

import numpy as np
from numba import njit

from mmjax.data.layout import AssemblyLayout, check_shapes
from mmjax.data.records import source_problem
from mmjax.data.skipped import Skipped
from mmjax.data.shuffle import index_shuffle
from mmjax.data.spec_columns import SpecColumns
from mmjax.data.table_records import TableRecords, concat_records

SEED_MUL, SALT_MUL = 1_000_003, 7_919  # the stream's per-epoch seed (`_index`'s)


def stream_indices(positions: np.ndarray, n: int, seed: int, shuffle: bool,
                   salt: int = 0) -> np.ndarray:
    """Dataset index at each stream position (`GlobalBatchBuilder._index`): epoch e is a
    seeded permutation of [0, n)."""
    epoch, i = np.divmod(np.asarray(positions, np.int64), n)
    if not (shuffle or salt) or i.size == 0:
        return i
    def shuffled(at, e):
        return index_shuffle(at, n - 1, (seed * SEED_MUL + e + salt * SALT_MUL) % (1 << 32))
    lo, hi = int(epoch.min()), int(epoch.max())
    if lo == hi:  # one epoch (a window within it): no mask per epoch
        return shuffled(i, lo)
    out = np.empty_like(i)
    for e in np.unique(epoch).tolist():
        at = epoch == e
        out[at] = shuffled(i[at], e)
    return out


def candidate_shapes(source, layout: AssemblyLayout, indices: np.ndarray):
    """(per index whether its shapes are usable, positions -> their `SpecColumns`,
    position -> its spec): from the source's `spec_table()` where it has one (the
    positions' records as `TableRecords`, gathered only when read), else from its
    `specs(indices)` or its `spec` per index."""
    table = getattr(source, "spec_table", None)
    if table is not None:
        t = table()
        return (t.usable(layout)[indices], lambda at: TableRecords(t, indices[at]),
                lambda j: source.spec(int(indices[j])))
    bulk = getattr(source, "specs", None)
    specs = bulk(indices) if bulk is not None else [source.spec(i) for i in indices.tolist()]
    c = SpecColumns.from_specs(specs)
    return c.usable(layout), c.take, specs.__getitem__


def problem_free(source, indices: np.ndarray) -> np.ndarray:
    """Per index whether the source names no problem with it (`source_problem`)."""
    bulk = getattr(source, "problem_free", None)
    if bulk is not None:
        return bulk(indices)
    if getattr(source, "problem", None) is None:
        return np.ones(indices.size, bool)
    return np.fromiter((source.problem(i) is None for i in indices.tolist()), bool,
                       indices.size)


class Draws:
    """The candidates of one global batch: its window of `window` stream positions from
    `start`, then min(n, `replacements` * window) positions of the second stream (salt 1)
    at the same start, as dataset indices."""

    def __init__(self, n: int, seed: int, shuffle: bool, start: int, window: int,
                 replacements: int):
        self.n, self.seed, self.shuffle, self.start = n, seed, shuffle, start
        self.window = window
        self.total = window + min(n, replacements * window)

    def indices(self, a: int, b: int) -> np.ndarray:
        """Dataset indices of draws [a, b)."""
        w, parts = self.window, []
        if a < w:
            pos = np.arange(self.start + a, self.start + min(b, w))
            parts.append(stream_indices(pos, self.n, self.seed, self.shuffle))
        if b > w:
            pos = np.arange(self.start + max(a, w) - w, self.start + b - w)
            parts.append(stream_indices(pos, self.n, self.seed, self.shuffle, salt=1))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def distinct(self, a: int, b: int) -> bool:
        """Whether draws [a, b) are surely distinct indices (one epoch of one stream)."""
        s = self.start
        if a < self.window <= b - 1:
            return False
        lo, hi = (s + a, s + b - 1) if a < self.window else (s + a - self.window,
                                                             s + b - 1 - self.window)
        return lo // self.n == hi // self.n


MARKS = 1 << 22  # `first_seen` marks up to this many indices whatever the draws' count


def first_seen(ind: np.ndarray, seen: list[np.ndarray], distinct: bool,
               n: int = 0) -> np.ndarray:
    """Per draw whether its index is new: not in `seen` nor earlier in `ind`. With `n`
    (indices in [0, n), not too many for their count) one pass over a mark per index,
    else sorting (`np.unique`, `np.isin`)."""
    if distinct and not seen:
        return np.ones(ind.size, bool)
    total = ind.size + sum(x.size for x in seen)
    if 0 < n <= max(MARKS, 16 * total):
        mark = np.zeros(n, np.bool_)
        for x in seen:
            mark[x] = True
        return _first_marks(ind, mark)
    if distinct:
        new = np.ones(ind.size, bool)
    else:
        new = np.zeros(ind.size, bool)
        new[np.unique(ind, return_index=True)[1]] = True
    if seen:
        new &= ~np.isin(ind, np.concatenate(seen))
    return new


@njit(cache=True)
def _first_marks(ind, mark):
    """Per entry of `ind` whether `mark` did not hold it yet; marks it."""
    out = np.empty(ind.size, np.bool_)
    for k in range(ind.size):
        out[k] = not mark[ind[k]]
        mark[ind[k]] = True
    return out


def pick(source, layout: AssemblyLayout, draws: Draws, count: int, budget: bool,
         skipped: list | None):
    """(indices, their `SpecColumns`, skip reasons, distinct candidates drawn): without
    `budget` the first `count` usable candidates; with it every usable candidate of the
    window, then of the replacements until there are `count`. Each unusable candidate's
    a `Skipped` record is appended to `skipped`, in draw order."""
    got: list[np.ndarray] = []
    cols: list[SpecColumns | TableRecords] = []
    reasons: dict[str, int] = {}
    seen: list[np.ndarray] = []
    have = drawn = a = 0
    while a < draws.total and not (have >= count if not budget else
                                   a >= draws.window and have >= count):
        # the draws expected to give what is missing (at the usable share so far), + 25%
        size = draws.window if budget and a < draws.window else (
            count - have if not a else max(64, (count - have) * a // max(have, 1) * 5 // 4))
        b = min(draws.total, a + size)
        ind = draws.indices(a, b)
        at = np.flatnonzero(first_seen(ind, seen, draws.distinct(a, b), draws.n))
        cand = ind[at]
        ok, take, spec = candidate_shapes(source, layout, cand)
        ok &= problem_free(source, cand)
        why = _reasons(source, layout, cand, spec, ok)
        used, stop = _consumed(at, ok, a, b, draws.window, count - have, budget)
        keep = np.flatnonzero(ok[:used])
        got.append(cand[keep])
        cols.append(take(keep))
        for j in sorted(k for k in why if k < used):
            kind = why[j].split(":")[0]
            reasons[kind] = reasons.get(kind, 0) + 1
            if skipped is not None:
                i = int(cand[j])
                skipped.append(Skipped.of(source, i, why[j]))
        have, drawn = have + keep.size, drawn + used
        seen.append(cand[:used])
        if stop:
            break
        a = b
    idx = np.concatenate(got) if got else np.zeros(0, np.int64)
    return (idx.tolist(), concat_records(cols) if cols else SpecColumns.from_specs([]),
            reasons, drawn)


def _reasons(source, layout: AssemblyLayout, cand: np.ndarray, spec, ok: np.ndarray) -> dict:
    """Candidate position -> why it is unusable, for each not `ok` (the per-sample
    check: where it finds nothing, the candidate is usable after all and `ok` is set)."""
    out = {}
    for j in np.flatnonzero(~ok).tolist():
        i = int(cand[j])
        why = source_problem(source, i) or check_shapes(spec(j), layout)
        if why:
            out[j] = why
        else:
            ok[j] = True
    return out


def _consumed(at: np.ndarray, ok: np.ndarray, a: int, b: int, window: int, short: int,
              budget: bool) -> tuple[int, bool]:
    """(candidates of draws [a, b) the one-at-a-time rule takes, whether it stops there):
    without a budget up to the `short`-th usable one; with one up to the first draw at or
    past the window with `short` usable ones before it. `at`: the draw offsets of the
    candidates (the new indices), `ok`: which are usable."""
    c = np.concatenate([[0], np.cumsum(ok, dtype=np.int64)])
    if not budget:
        j = int(np.searchsorted(c, short, side="left"))
        return min(j, ok.size), j <= ok.size
    k = np.searchsorted(at, np.arange(b - a), side="left")  # candidates before each draw
    stop = np.flatnonzero((np.arange(a, b) >= window) & (c[k] >= short))
    return (int(k[stop[0]]), True) if stop.size else (ok.size, False)
