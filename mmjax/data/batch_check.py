"""`--check`'s look at a global batch (no JAX): selected and planned from metadata alone
(every sample's shapes, the balancing, every unit's shapes), then decoded and assembled as
a run would; a global batch of more than `CHECK_DECODE` samples has only its first
`CHECK_DECODE` decoded and assembled (one batch), so `--check` at any batch size takes
the time of its metadata, not of materialising every sample (issue 41, docs/packing.md)."""
from __future__ import annotations

from collections.abc import Callable

from mmjax.data.assemble import assemble
from mmjax.data.batch_plan import plan_global_batch
from mmjax.data.meta_columns import MetaColumns

CHECK_DECODE = 512  # samples of a larger global batch that `--check` decodes and assembles


def check_global_batch(builder, step: int = 0, decode: int = CHECK_DECODE,
                       on_metadata: Callable[[MetaColumns], None] | None = None) -> int:
    """Select global batch `step` of `builder` (a `GlobalBatchBuilder`), call
    `on_metadata` with its metadata (the memory check: it refuses before anything is
    decoded), plan it and compute every microbatch's unit shapes, then build it as the
    run does (`builder(step)`) when it has at most `decode` samples, else decode (checking
    each against its index) and assemble its first `decode`. -> samples decoded."""
    layout = builder.layout
    idx, specs, _ = builder.select(step)
    metas = MetaColumns.from_specs(idx, specs, layout.rules)
    if on_metadata is not None:
        on_metadata(metas)
    for mp in plan_global_batch(metas, builder.model, builder.plan, layout,
                                builder.policies, builder.algo, node_wise=builder.node_wise,
                                hardware=builder.hardware):
        for unit in mp.splits:
            mp.shapes[unit]  # noqa: B018 (computed: a shape no bucket holds raises here)
    if len(idx) <= decode:
        builder(step)
        return len(idx)
    get = builder.sample_getter(idx, specs, metas, [], set())
    assemble([get(p) for p in range(decode)], layout)
    return decode
