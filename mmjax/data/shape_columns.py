"""A global batch's sample metadata as flat numpy columns (no JAX): what planning reads per
sample, read from the per-segment `MetaColumns` (data/meta_columns.py), so the balancing costs
(`batch_plan.unit_costs`) and every unit's per-rank shapes (`batch_shapes.rank_shapes`)
are array work over index splits, not per-sample Python once per unit (issue 41: host
planning linear in the batch)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmjax.data.layout import AssemblyLayout
from mmjax.data.meta_columns import CODE, MetaColumns
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


def shape_columns(metas: "list[SampleMeta] | MetaColumns", layout: AssemblyLayout,
                  modalities: tuple[str, ...] = ()) -> ShapeColumns:
    """The columns of `metas` (`SampleMeta`s or already `MetaColumns`); `encoder_tokens`
    for `modalities` (and the layout's). Array work over the per-segment columns."""
    mc = metas if isinstance(metas, MetaColumns) else MetaColumns.from_metas(metas)
    n = len(mc)
    sample = np.repeat(np.arange(n, dtype=np.int64), mc.counts)
    slots = {s.modality: s for s in layout.encoders}
    tokens = {}
    for m in sorted(set(modalities) | set(slots)):
        at = mc.modality == CODE[m]
        tokens[m] = np.bincount(sample[at], mc.encoder_tokens[at], n).astype(np.int64)
    items = {}
    for m, slot in slots.items():
        at = mc.modality == CODE[m]
        v = mc.input_size[at]
        if m == "image":  # patches rounded up to the downsample (`batch_shapes.image_runs`)
            r = slot.downsample
            v = -(-v // r) * r
        items[slot.name] = Ragged(v, np.bincount(sample[at], minlength=n).astype(np.int64))
    return ShapeColumns(mc.llm_length, mc.count("image_out"), tokens, items)
