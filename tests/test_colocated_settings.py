"""`manual_plan.layout` / `zero_stage` / `fsdp_group` / `tp` in the co-located layout: what
each gives, and the one-line error (setting, why, fix) for what a layout cannot take,
raised before any work (no JAX program runs here)."""
import pytest

from mmjax.errors import UserError
from mmjax.models.tiny import tiny_valm
from mmjax.train.colocated_plan import Colocation, check_colocated_run, check_layout
from mmjax.train.manual_plan import manual_plan

UNITS = ("vision", "audio", "llm")


def test_encoder_tp_in_a_colocation():
    """Encoders take their own tp; the sizes must nest (each divides the next)."""
    colo = check_layout(UNITS, 8, "colocated", tp={"vision": 2, "llm": 4}, model=tiny_valm())
    assert colo == Colocation(4, (), 1, None, (("vision", 2),))
    assert [colo.tp_of(u) for u in UNITS] == [2, 1, 4] and colo.tp_sizes == (2, 4)
    assert colo.max_tp == 4
    with pytest.raises(UserError) as e:
        check_layout(UNITS, 12, "colocated", tp={"vision": 4, "llm": 6})
    msg = str(e.value)
    assert msg.startswith("manual_plan.tp={'vision': 4, 'llm': 6}: tp 4 does not divide tp 6 "
                          "(the co-located mesh nests each unit's tp group") and "\n" not in msg
    assert msg.endswith("e.g. 4 and 4 for 6)"), msg


def test_colocated_settings_give_a_colocation():
    colo = check_layout(UNITS, 8, "colocated", {"llm": 3, "vision": 2}, 4, tp={"llm": 2})
    assert colo == Colocation(2, (("llm", 3), ("vision", 2)), 1, 4)
    assert [colo.stage(u) for u in UNITS] == [2, 1, 3]
    assert check_layout(UNITS, 8, "colocated", 3) == Colocation(1, (), 3, None)
    assert check_layout(UNITS, 8) is None  # disaggregated: the pipeline runtime's Plan
    dis = manual_plan(global_batch=8, model=tiny_valm(), zero_stage={"llm": 3, "vision": 2})
    assert dis.colocation is None and dis.pipelined
    assert {u.name: u.zero_stage for u in dis.chosen.units} == {"vision": 2, "audio": 1, "llm": 3}
    colo = manual_plan(global_batch=8, model=tiny_valm(), layout="colocated", zero_stage=2)
    assert colo.colocation == Colocation(1, (), 2, None) and colo.chosen is None


@pytest.mark.parametrize("kw,line", [
    (dict(layout="colocated", zero_stage=4),
     "manual_plan.zero_stage=4: no such ZeRO stage (use 1: optimizer state sharded, 2: also "
     "the gradients, 3: also the parameters)"),
    (dict(layout="colocated", zero_stage={"llm": 0}), "manual_plan.zero_stage['llm']=0: no such"),
    (dict(layout="colocated", zero_stage={"vison": 2}), "unknown unit(s) ['vison']"),
    (dict(layout="mixed"), "manual_plan.layout='mixed': no such layout (use \"disaggregated\""),
    (dict(zero_stage=4), "manual_plan.zero_stage=4: no such ZeRO stage (use 1: optimizer "
     "state sharded, 2: also the gradients, 3: also the parameters)"),
    (dict(fsdp_group={"vison": 2}), "manual_plan.fsdp_group={'vison': 2}: unknown unit(s) "
     "['vison']"),
    (dict(layout="colocated", pp={"llm": 2}), "manual_plan.pp={'llm': 2}: the co-located "
     "layout runs every unit data-parallel over all 8 devices in one program, without "
     "pipelining"),
    (dict(layout="colocated", dp={"vision": 4}), "manual_plan.dp={'vision': 4}: the co-located"),
    (dict(layout="colocated", tp={"llm": 3}), "manual_plan.tp['llm']=3: does not divide the 8 "
     "devices (use a divisor of 8)"),
    (dict(layout="colocated", tp=2), "manual_plan.tp=2: in the co-located layout only the "
     "llm and the encoders take tp, per unit"),
    (dict(layout="colocated", tp={"vision": 3}), "manual_plan.tp['vision']=3: does not divide "
     "the 8 devices (use a divisor of 8)"),
    (dict(layout="colocated", tp={"vision": 4}, model=tiny_valm()), "manual_plan.tp['vision']=4:"
     " does not divide vision.num_heads=2 (use a tp dividing 2)"),
    (dict(layout="colocated", tp={"vision": 2, "llm": 3}), "manual_plan.tp['llm']=3: does not "
     "divide the 8 devices"),
    (dict(layout="colocated", tp={"vision": 2, "audio": 3, "llm": 1}),
     "manual_plan.tp['audio']=3: does not divide the 8 devices"),
    (dict(layout="colocated", tp={"llm": 2}, fsdp_group=3), "manual_plan.fsdp_group=3: must "
     "divide the 8 devices and be a multiple of the largest tp 2"),
    (dict(layout="colocated", tp={"llm": 2, "vision": 4}, fsdp_group=2),
     "manual_plan.fsdp_group=2: must divide the 8 devices and be a multiple of the largest "
     "tp 4"),
    (dict(layout="colocated", tp={"llm": 4}, fsdp_group=2), "manual_plan.fsdp_group=2: must"),
])
def test_bad_layout_settings_are_one_line(kw, line):
    with pytest.raises(UserError) as e:
        check_layout(UNITS, 8, **kw)
    msg = str(e.value)
    assert line in msg and "\n" not in msg and "(" in msg and msg.endswith(")")


def test_colocated_refuses_replanning_and_traces():
    check_colocated_run(0, 0, None)
    with pytest.raises(UserError, match=r"train.replan_every=5: the co-located layout is one "
                       r"SPMD program"):
        check_colocated_run(5, 0, None)
