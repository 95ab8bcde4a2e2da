"""A global batch's sample metadata as flat numpy columns (no JAX): what planning reads per
sample, extracted in one pass over the `SampleMeta`s, so the balancing costs
(`batch_plan.unit_costs`) and every unit's per-rank shapes (`batch_shapes.rank_shapes`)
are array work over index splits, not per-sample Python once per unit (issue 41: host
planning linear in the batch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmjax.data.layout import AssemblyLayout
from mmjax.data.sample import SampleMeta


@dataclass(frozen=True)
class Ragged:
    """Per sample a run of values: `values[starts[i]:starts[i] + counts[i]]`."""

    values: np.ndarray  # int64, sample after sample
    counts: np.ndarray  # int64 [samples]

    @property
    def starts(self) -> np.ndarray:
        return np.cumsum(self.counts) - self.counts

    def take(self, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values of samples `items`, in that order, flat; their counts)."""
        counts = self.counts[items]
        total = int(counts.sum())
        if total == 0:
            return np.zeros(0, np.int64), counts
        shift = np.repeat(self.starts[items] - (np.cumsum(counts) - counts), counts)
        return self.values[shift + np.arange(total)], counts


@dataclass(frozen=True)
class ShapeColumns:
    """Per sample: LLM sequence tokens (`llm_length`), images generated, encoder tokens
    per modality; per encoder slot its items' sizes (vision: patches rounded up to the
    slot's downsample, as `batch_shapes.image_runs`; audio: frames)."""

    llm: np.ndarray  # int64 [samples]
    image_out: np.ndarray  # int64 [samples]
    encoder_tokens: dict[str, np.ndarray]  # modality -> int64 [samples]
    items: dict[str, Ragged]  # encoder slot name -> its items' sizes


def shape_columns(metas: list[SampleMeta], layout: AssemblyLayout,
                  modalities: tuple[str, ...] = ()) -> ShapeColumns:
    """The columns of `metas`; `encoder_tokens` for `modalities` (and the layout's). One
    attribute read per segment field (list comprehensions), the rest numpy."""
    n = len(metas)
    segs = [s for m in metas for s in m.segments]
    ends = np.cumsum(np.fromiter((len(m.segments) for m in metas), np.int64, n))
    sample = np.repeat(np.arange(n, dtype=np.int64), np.diff(ends, prepend=0))
    mod = np.array([s.modality for s in segs] or [""])[:len(segs)]
    llm = 2 + _sum_by(ends, np.fromiter((s.num_llm_tokens + s.delimiters for s in segs),
                                          np.int64, len(segs)), n)
    enc = np.fromiter((s.num_encoder_tokens for s in segs), np.int64, len(segs))
    size = np.fromiter((s.input_size for s in segs), np.int64, len(segs))
    slots = {s.modality: s for s in layout.encoders}
    tokens = {m: _sum_by(ends, np.where(mod == m, enc, 0), n)
              for m in sorted(set(modalities) | set(slots))}
    items = {}
    for m, slot in slots.items():
        at = mod == m
        v = size[at]
        if m == "image":  # patches rounded up to the downsample (`batch_shapes.image_runs`)
            r = slot.downsample
            v = -(-v // r) * r
        items[slot.name] = Ragged(v, np.bincount(sample[at], minlength=n).astype(np.int64))
    return ShapeColumns(llm, _sum_by(ends, (mod == "image_out").astype(np.int64), n),
                        tokens, items)


def _sum_by(ends: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """Per sample the sum of `x` over its segments (sample i's: `x[ends[i - 1]:ends[i]]`)."""
    c = np.concatenate([[0], np.cumsum(x, dtype=np.int64)])
    return c[ends] - c[np.concatenate([[0], ends[:-1]])] if n else np.zeros(0, np.int64)
