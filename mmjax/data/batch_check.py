"""`--check`'s look at a global batch (no JAX): selected and planned from metadata alone
(every sample's shapes, the balancing, every unit's shapes), then decoded and assembled as
a run would; a global batch of more than `CHECK_DECODE` samples has only its first
`CHECK_DECODE` decoded and assembled (one batch), so `--check` at any batch size takes
the time of its metadata, not of materialising every sample (issue 41, docs/packing.md)."""
from __future__ import annotations

from collections.abc import Callable

from mmjax.data.assemble import assemble
from mmjax.data.meta_columns import MetaColumns
from mmjax.data.sample_stream import SampleStream
from mmjax.data.spec_list import meta_columns_of

CHECK_DECODE = 512  # samples of a larger global batch that `--check` decodes and assembles


def check_global_batch(data, step: int = 0, decode: int = CHECK_DECODE,
                       on_metadata: Callable[[MetaColumns], None] | None = None) -> int:
    """Select global batch `step` of `data` (a plan's `GlobalBatchBuilder`, or the single
    program's `SampleStream`), call `on_metadata` with its metadata (the memory check: it
    refuses before anything is decoded); with a plan, plan it and compute every
    microbatch's unit shapes, then build it as the run does (`builder(step)`) when it has
    at most `decode` samples; else (or with no plan) decode, checking each sample against
    its index, and assemble its first `decode`. -> samples decoded."""
    stream = data if isinstance(data, SampleStream) else data.stream
    layout = stream.layout
    idx, specs, _ = stream.select(step)
    metas = meta_columns_of(idx, specs, layout.rules)
    if on_metadata is not None:
        on_metadata(metas)
    if stream is not data:
        for mp in data.plan_microbatches(metas):
            for unit in mp.splits:
                mp.shapes[unit]  # noqa: B018 (computed: a shape no bucket holds raises here)
        if len(idx) <= decode:
            data(step)
            return len(idx)
    n = min(decode, len(idx))
    get = stream.sample_getter(idx, specs, metas, [], set())
    assemble([get(p) for p in range(n)], layout)
    return n
