"""The fill of a global batch's plan (no JAX): the share of the LLM's token slots (rows x
seq_len on every DP rank of every microbatch, the static shapes a step computes on) and of
an image encoder's patch slots (buffers x capacity) that hold real tokens. What
`metrics.jsonl`'s `llm_fill` reports per step, from metadata alone (docs/packing.md)."""
from __future__ import annotations

from collections.abc import Sequence

from mmjax.data.batch_plan import MicrobatchPlan
from mmjax.data.layout import AssemblyLayout
from mmjax.data.sample import SampleMeta
from mmjax.models.units import LLM_UNIT


def llm_fill(plans: Sequence[MicrobatchPlan], metas: list[SampleMeta],
             layout: AssemblyLayout, dp: int) -> float:
    """Real LLM tokens of the global batch / the slots of its microbatches' shapes (every one
    of the LLM's `dp` ranks computes `rows` rows of `seq_len`)."""
    slots = sum(dp * mp.shapes[LLM_UNIT].rows for mp in plans) * layout.seq_len
    tokens = sum(metas[p].llm_length for mp in plans for p in mp.positions)
    return tokens / slots if slots else 0.0


def encoder_fill(plans: Sequence[MicrobatchPlan], metas: list[SampleMeta],
                 layout: AssemblyLayout, encoder: str, dp: int) -> float:
    """An image encoder's real patches (runs padded to its projector's downsample, as packed)
    / its buffer slots (count x capacity on each of its `dp` ranks); 1.0 without images."""
    from mmjax.data.batch_shapes import image_runs

    slot = next(s for s in layout.encoders if s.name == encoder)
    real = sum(sum(image_runs([metas[p]], slot)) for mp in plans for p in mp.positions)
    slots = 0
    for mp in plans:
        count, cap = mp.shapes[encoder].encoder(encoder)
        slots += dp * count * cap
    return real / slots if real else 1.0
