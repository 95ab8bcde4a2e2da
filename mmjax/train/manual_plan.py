"""`manual_plan`: a Plan from per-unit gin settings (`train.plan = "manual"`)."""
from __future__ import annotations

import gin

from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan
from mmjax.train.validate import check_manual_plan


@gin.configurable
def manual_plan(global_batch: int = 8, num_microbatches: int = 2, dp=None, tp=None, pp=None,
                cp=None, num_chunks=None, overlap_tp=None, model: MLLMConfig | None = None,
                remat=None, tp_chunks=None, tp_bidirectional=None, cp_head_groups=None,
                attention_impl=None) -> Plan:
    """A Plan from per-unit dicts, e.g. `manual_plan.pp = {"llm": 2}` or
    `manual_plan.remat = "dots"` / `manual_plan.attention_impl = "chunked"` in gin (a plain
    value applies to every unit)."""
    knobs = dict(dp=dp, tp=tp, pp=pp, cp=cp, num_chunks=num_chunks, overlap_tp=overlap_tp,
                 remat=remat, tp_chunks=tp_chunks, tp_bidirectional=tp_bidirectional,
                 cp_head_groups=cp_head_groups, attention_impl=attention_impl)
    check_manual_plan(model.unit_names, global_batch, num_microbatches, **knobs)
    kw = {k: v for k, v in knobs.items() if v is not None}
    return Plan.uniform(model, global_batch, num_microbatches, **kw)
