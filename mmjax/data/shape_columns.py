"""A global batch's sample metadata as flat numpy columns (no JAX): what planning reads per
sample, extracted in one pass over the `SampleMeta`s, so the balancing costs
(`batch_plan.unit_costs`) and every unit's per-rank shapes (`batch_shapes.rank_shapes`)
are array work over index splits, not per-sample Python once per unit (issue 41: host
planning linear in the batch)."""
from __future__ import annotations

import math
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
    """One pass over `metas`; `encoder_tokens` for `modalities` (and the layout's)."""
    slots = {s.modality: s for s in layout.encoders}
    mods = tuple(sorted(set(modalities) | set(slots)))
    llm, out = [], []
    tokens = {m: [] for m in mods}
    sizes = {m: [] for m in slots}
    counts = {m: [] for m in slots}
    down = {m: s.downsample if s.modality == "image" else 0 for m, s in slots.items()}
    for meta in metas:
        n_llm, n_out = 2, 0
        per_tok = dict.fromkeys(mods, 0)
        per_count = dict.fromkeys(slots, 0)
        for seg in meta.segments:
            mod = seg.modality
            n_llm += seg.num_llm_tokens + seg.delimiters
            if mod in per_tok:
                per_tok[mod] += seg.num_encoder_tokens
                if mod in per_count:
                    r = down[mod]
                    sizes[mod].append(math.ceil(seg.input_size / r) * r if r else seg.input_size)
                    per_count[mod] += 1
            elif mod == "image_out":
                n_out += 1
        llm.append(n_llm)
        out.append(n_out)
        for m in mods:
            tokens[m].append(per_tok[m])
        for m in slots:
            counts[m].append(per_count[m])
    return ShapeColumns(
        np.array(llm, np.int64), np.array(out, np.int64),
        {m: np.array(v, np.int64) for m, v in tokens.items()},
        {slots[m].name: Ragged(np.array(sizes[m], np.int64), np.array(counts[m], np.int64))
         for m in slots})
