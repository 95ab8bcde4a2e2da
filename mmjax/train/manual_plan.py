"""`manual_plan`: the run's layout from per-unit gin settings (`train.plan = "manual"`):
`manual_plan.layout` acts here, giving a disaggregated Plan or a `Colocation`."""
from __future__ import annotations

import gin
import jax

from mmjax.models.config import MLLMConfig
from mmjax.planner.plan import Plan
from mmjax.train.colocated_plan import check_layout
from mmjax.train.run_layout import RunLayout
from mmjax.train.validate import check_manual_batches, check_manual_plan


@gin.configurable
def manual_plan(global_batch: int = 8, num_microbatches: int = 2, dp=None, tp=None, pp=None,
                cp=None, num_chunks=None, overlap_tp=None, model: MLLMConfig | None = None,
                remat=None, tp_chunks=None, tp_bidirectional=None, cp_head_groups=None,
                attention_impl=None, layout: str = "disaggregated", zero_stage=None,
                fsdp_group=None) -> RunLayout:
    """The run's layout: a disaggregated Plan (`RunLayout.chosen`) from per-unit dicts,
    e.g. `manual_plan.pp = {"llm": 2}`, `manual_plan.remat = "dots"`,
    `manual_plan.attention_impl = "chunked"`, `manual_plan.zero_stage = 3` in gin (a plain
    value applies to every unit). `layout = "colocated"`: a `Colocation` instead
    (`RunLayout.colocation`: every unit on all devices, `tp = {"llm": T, "vision": V}`,
    `zero_stage` 1-3 per unit, `fsdp_group` devices per FSDP group;
    train/colocated_plan.py)."""
    if model is None:
        raise TypeError("manual_plan(model=...): the program passes the model")
    knobs = dict(dp=dp, tp=tp, pp=pp, cp=cp, num_chunks=num_chunks, overlap_tp=overlap_tp,
                 remat=remat, tp_chunks=tp_chunks, tp_bidirectional=tp_bidirectional,
                 cp_head_groups=cp_head_groups, attention_impl=attention_impl)
    check_manual_plan(model.unit_names, global_batch, num_microbatches, layout=layout,
                      zero_stage=zero_stage, fsdp_group=fsdp_group, **knobs)
    colo = check_layout(model.unit_names, jax.device_count(), layout, zero_stage,
                        fsdp_group, model=model, **knobs)
    if colo is not None:
        return RunLayout("manual", colocation=colo)
    check_manual_batches(global_batch, num_microbatches, dp)
    kw = {k: v for k, v in knobs.items() if v is not None}
    if zero_stage is not None:  # ZeRO 1-3 per unit over each stage's dp ranks
        kw["zero_stage"] = zero_stage
    if fsdp_group is not None:  # devices per FSDP group in each of the unit's stages
        kw["fsdp_group"] = fsdp_group
    return RunLayout("manual", chosen=Plan.uniform(model, global_batch, num_microbatches, **kw))
