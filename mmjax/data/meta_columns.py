"""A global batch's sample metadata as flat per-segment arrays (no JAX): `MetaColumns`,
what `SampleMeta`s hold, built in bulk from the source's shapes (data/spec_list.py: the
`TokenRules` rules as array arithmetic, one list pass per field instead of one
`SegmentMeta` object per segment), so planning reads arrays end to end (issue 41: host
planning linear in the batch). `SampleMeta` objects are built only where per-sample code
still needs them (`meta`, `metas`)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from mmjax.data.sample import AUDIO_STRIDE, MODALITIES, SampleMeta, SegmentMeta, TokenRules

if TYPE_CHECKING:
    from mmjax.data.layout import AssemblyLayout

CODE = {m: i for i, m in enumerate(MODALITIES)}  # modality -> int8 code
TEXT, IMAGE, AUDIO, IMAGE_OUT = (CODE[m] for m in MODALITIES)
_FIELDS = ("llm_tokens", "encoder_tokens", "input_size", "masked", "delimiters")


@dataclass(frozen=True, eq=False)
class MetaColumns:
    """Per sample its id and segment count; per segment (sample after sample) the fields
    of its `SegmentMeta`: modality code (`CODE`), LLM tokens, encoder tokens, input size,
    masked text tokens, delimiter tokens."""

    ids: np.ndarray  # int64 [samples]
    counts: np.ndarray  # int64 [samples], segments per sample
    modality: np.ndarray  # int8 [segments]
    llm_tokens: np.ndarray  # int64 [segments]
    encoder_tokens: np.ndarray
    input_size: np.ndarray
    masked: np.ndarray
    delimiters: np.ndarray

    def __len__(self) -> int:
        return int(self.ids.size)

    @cached_property
    def ends(self) -> np.ndarray:
        """Per sample the end of its segments (sample p's: `[ends[p] - counts[p], ends[p])`)."""
        return np.cumsum(self.counts)

    @classmethod
    def from_metas(cls, metas: list[SampleMeta]) -> "MetaColumns":
        segs = [s for m in metas for s in m.segments]
        k = len(segs)
        cols = [np.fromiter((getattr(s, f) for s in segs), np.int64, k) for f in
                ("num_llm_tokens", "num_encoder_tokens", "input_size", "num_masked",
                 "delimiters")]
        return cls(np.fromiter((m.id for m in metas), np.int64, len(metas)),
                   np.fromiter((len(m.segments) for m in metas), np.int64, len(metas)),
                   np.fromiter((CODE[s.modality] for s in segs), np.int8, k), *cols)

    def record_shapes(self, layout: "AssemblyLayout",
                      modalities: tuple[str, ...]) -> Any:
        """`shape_columns` of these samples (a `data/shape_columns.py` `ShapeColumns`, which
        imports this module, hence `Any` here) when they are known without a pass over
        their segments (records of a table, data/table_meta.py), else None."""
        return None

    def __getitem__(self, p: int) -> SampleMeta:
        return self.meta(p)

    def meta(self, p: int) -> SampleMeta:
        """Sample `p`'s `SampleMeta` (equal to `TokenRules.meta_from_shapes`'s)."""
        e = int(self.ends[p])
        return self._meta(p, e - int(self.counts[p]), e)

    def metas(self) -> list[SampleMeta]:
        ends = self.ends.tolist()
        return [self._meta(p, s, e) for p, (s, e) in enumerate(zip([0] + ends[:-1], ends))]

    def _meta(self, p: int, s: int, e: int) -> SampleMeta:
        rows = zip(self.modality[s:e].tolist(), *(getattr(self, f)[s:e].tolist()
                                                  for f in _FIELDS))
        return SampleMeta(int(self.ids[p]), tuple(
            SegmentMeta(MODALITIES[c], *v) for c, *v in rows))

    def per_sample(self, x: np.ndarray) -> np.ndarray:
        """Per sample the sum of the per-segment `x` over its segments."""
        c = np.concatenate([[0], np.cumsum(x, dtype=np.int64)])
        ends = self.ends
        return c[ends] - c[ends - self.counts]

    @property
    def llm_length(self) -> np.ndarray:
        """`SampleMeta.llm_length` of every sample."""
        return 2 + self.per_sample(self.llm_tokens + self.delimiters)

    def count(self, modality: str) -> np.ndarray:
        return self.per_sample(self.modality == CODE[modality])

    @property
    def num_targets(self) -> np.ndarray:
        """`SampleMeta.num_targets` of every sample."""
        masked = self.per_sample(self.masked)
        text = self.modality == TEXT
        trained = self.per_sample(np.where(text, self.llm_tokens - self.masked, 0))
        placeholders = self.per_sample(np.where(text, 0, self.llm_tokens))
        return np.where(masked > 0, trained, self.llm_length - placeholders - 1)


def segment_fields(rules: TokenRules, code, d0, d1, d2, queries, masked):
    """`TokenRules.segment_meta` over arrays: (llm tokens, encoder tokens, input size,
    masked, delimiters) per segment from its modality code and shape dims (d0, d1, d2:
    the shape's first three entries, 0 where it has fewer) and num_queries / num_masked."""
    llm, size = d0.astype(np.int64), d0.astype(np.int64)  # text: L; audio's size: T
    enc = np.zeros(code.size, np.int64)
    at = np.flatnonzero(code == IMAGE)
    p = rules.patch_size
    n = (d0[at] // p) * (d1[at] // p)
    llm[at] = rules.image_queries or -(-n // rules.image_downsample)
    enc[at], size[at] = n, n
    at = np.flatnonzero(code == AUDIO)
    n = -(-d0[at] // AUDIO_STRIDE)
    llm[at] = rules.audio_queries or -(-n // rules.audio_downsample)
    enc[at] = n
    at = np.flatnonzero(code == IMAGE_OUT)
    g = rules.gen_patch_size * rules.gen_downsample
    n = (d1[at] // g) * (d2[at] // g)
    llm[at] = queries[at]
    enc[at], size[at] = n, n
    text = code == TEXT
    delim = np.where(text, 0, 2 if rules.markers else 0).astype(np.int64)
    return llm, enc, size, np.where(text, masked, 0).astype(np.int64), delim
