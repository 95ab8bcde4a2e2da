"""A global batch's sample metadata as flat numpy columns (no JAX): what planning reads per
sample, read from the per-segment `MetaColumns` (data/meta_columns.py), so the balancing costs
(`batch_plan.unit_costs`) and every unit's per-rank shapes (`batch_shapes.rank_shapes`)
are array work over index splits, not per-sample Python once per unit (issue 41: host
planning linear in the batch)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numba import njit

from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import CODE, MetaColumns
from mmjax.data.sample import MODALITIES, SampleMeta


@dataclass(frozen=True)
class Ragged:
    """Per sample a run of values: `values[starts[i]:starts[i] + counts[i]]`."""

    values: np.ndarray  # int64, sample after sample
    counts: np.ndarray  # int64 [samples]

    @cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts

    def take(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values of samples `items`, in that order, flat, int64; their counts)."""
        counts = self.counts[items].astype(np.int64)
        return _gather(self.values, self.starts, counts, items), counts


@njit(cache=True)
def _gather(values, starts, counts, items):
    """The runs `values[starts[i]:starts[i] + counts[k]]` of `i = items[k]`, one after
    another (`counts`: the items' own counts)."""
    out = np.empty(counts.sum(), np.int64)
    j = 0
    for k in range(items.size):
        s = starts[items[k]]
        for t in range(counts[k]):
            out[j] = values[s + t]
            j += 1
    return out


@dataclass(frozen=True)
class ShapeColumns:
    """Per sample: LLM sequence tokens (`llm_length`), images generated, encoder tokens
    per modality; per encoder slot its items' sizes (vision: patches rounded up to the
    slot's downsample, as `batch_shapes.image_runs`; audio: frames)."""

    llm: np.ndarray  # int64 [samples]
    image_out: np.ndarray  # int64 [samples]
    encoder_tokens: dict[str, np.ndarray]  # modality -> int64 [samples]
    items: dict[str, Ragged]  # encoder slot name -> its items' sizes


class RecordShapes:
    """Every record's `ShapeColumns` of a data set as one row per record (LLM tokens,
    images generated, encoder tokens per modality, per encoder slot its items' count and
    first offset; the narrowest int type all fit: one cache line a record), built once
    (`SpecTable.record_shapes`); `take` gathers a batch's."""

    def __init__(self, cols: ShapeColumns):
        self.modalities, self.slots = tuple(cols.encoder_tokens), tuple(cols.items)
        self.values = {s: r.values for s, r in cols.items.items()}
        fields = [cols.llm, cols.image_out, *cols.encoder_tokens.values()]
        for r in cols.items.values():
            fields += [r.counts, r.starts]
        stacked = np.stack(fields, 1) if len(cols.llm) else np.zeros((0, len(fields)),
                                                                      np.int64)
        i32 = np.iinfo(np.int32)
        fits = stacked.size == 0 or (i32.min <= stacked.min() and stacked.max() <= i32.max)
        self.rows = np.ascontiguousarray(stacked.astype(np.int32) if fits else stacked)

    def take(self, items: np.ndarray) -> ShapeColumns:
        """`shape_columns` of records `items`, in that order (every column is per record,
        so equal to the columns of their gathered metadata), int64."""
        items = np.asarray(items, np.int64)
        f = _gather_rows(self.rows, items)
        k = 2 + len(self.modalities)
        ragged = {}
        for j, s in enumerate(self.slots):  # the batch's own runs: a plan (sent to the
            counts, first = f[k + 2 * j], f[k + 2 * j + 1]  # trainer) holds no table's
            ragged[s] = Ragged(_gather(self.values[s], first, counts, np.arange(items.size)),
                               counts)
        return ShapeColumns(f[0], f[1], dict(zip(self.modalities, f[2:k])), ragged)


@njit(cache=True)
def _gather_rows(rows, items):
    """[fields, items] int64: row `items[k]` of `rows` as column k."""
    out = np.empty((rows.shape[1], items.size), np.int64)
    for k in range(items.size):
        r = items[k]
        for f in range(rows.shape[1]):
            out[f, k] = rows[r, f]
    return out


def shape_columns(metas: "list[SampleMeta] | MetaColumns", layout: AssemblyLayout,
                  modalities: tuple[str, ...] = ()) -> ShapeColumns:
    """The columns of `metas` (`SampleMeta`s or already `MetaColumns`); `encoder_tokens`
    for `modalities` (and the layout's). One compiled pass over the segments."""
    mc = metas if isinstance(metas, MetaColumns) else MetaColumns.from_metas(metas)
    gathered = mc.record_shapes(layout, modalities)
    if gathered is not None:  # records of a table: its per-record columns, gathered
        return gathered
    llm, enc, count = _per_sample(mc.counts, mc.modality, mc.llm_tokens, mc.delimiters,
                                  mc.encoder_tokens, len(MODALITIES))
    slots = {s.modality: s for s in layout.encoders}
    tokens = {m: enc[CODE[m]] for m in sorted(set(modalities) | set(slots))}
    items = {}
    for m, slot in slots.items():
        v = mc.input_size[mc.modality == CODE[m]]
        if m == "image":  # patches rounded up to the downsample (`batch_shapes.image_runs`)
            r = slot.downsample
            v = -(-v // r) * r
        items[slot.name] = Ragged(v, count[CODE[m]])
    return ShapeColumns(llm, count[CODE["image_out"]], tokens, items)


@njit(cache=True)
def _per_sample(counts, modality, llm_tokens, delimiters, encoder_tokens, kinds):
    """Per sample: LLM length (2 + its segments' tokens and delimiters); per modality code
    its encoder tokens and its segment count ([kinds, samples] each)."""
    n = counts.size
    llm = np.empty(n, np.int64)
    enc = np.zeros((kinds, n), np.int64)
    count = np.zeros((kinds, n), np.int64)
    j = 0
    for i in range(n):
        t = 2
        for _ in range(counts[i]):
            c = modality[j]
            t += llm_tokens[j] + delimiters[j]
            enc[c, i] += encoder_tokens[j]
            count[c, i] += 1
            j += 1
        llm[i] = t
    return llm, enc, count
