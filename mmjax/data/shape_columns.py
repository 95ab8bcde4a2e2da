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
    """Per sample a run of values: `values[starts[i]:starts[i] + counts[i]]`, the runs one
    after another, or where `first` says (`view`: runs of some samples of a larger one)."""

    values: np.ndarray  # int64 (or narrower: `take` widens)
    counts: np.ndarray  # int64 [samples]
    first: np.ndarray | None = None  # int64 [samples]: where each run starts, if not packed

    @cached_property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts if self.first is None else self.first

    def take(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values of samples `items`, in that order, flat, int64; their counts)."""
        counts = self.counts[items].astype(np.int64)
        return _gather(self.values, self.starts, counts, items), counts

    def view(self, items: np.ndarray) -> "Ragged":
        """Samples `items`' runs, in that order, read in place (nothing gathered)."""
        return Ragged(self.values, self.counts[items].astype(np.int64),
                      self.starts[items].astype(np.int64))


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

    def take(self, items: np.ndarray) -> "ShapeColumns":
        """The columns of samples `items` (an index array), in that order, as int64
        (equal to `shape_columns` of their metadata: every column is per sample); the
        items' sizes as views (`Ragged.view`), gathered when a rank group reads them."""
        def t(x):
            return x[items].astype(np.int64)
        return ShapeColumns(t(self.llm), t(self.image_out),
                            {m: t(v) for m, v in self.encoder_tokens.items()},
                            {s: r.view(items) for s, r in self.items.items()})

    def narrow(self) -> "ShapeColumns":
        """These columns in the narrowest int type each fits (int32 or int64): a table of
        every record's (`SpecTable.record_shapes`) is gathered by `take`, which widens."""
        return ShapeColumns(_narrow(self.llm), _narrow(self.image_out),
                            {m: _narrow(v) for m, v in self.encoder_tokens.items()},
                            {s: Ragged(_narrow(r.values), _narrow(r.counts))
                             for s, r in self.items.items()})


def _narrow(x: np.ndarray) -> np.ndarray:
    i32 = np.iinfo(np.int32)
    fits = x.size == 0 or (i32.min <= x.min() and x.max() <= i32.max)
    return x.astype(np.int32) if fits else x


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
