"""Plan.validate: one rejection per rule (each message names the field and the fix), JSON
round trip, and the structure of the Megatron-style rigid plan (DistTrain §2.1). No JAX."""
import dataclasses

import pytest

from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny, tiny_valm
from mmjax.planner.plan import Plan, PlanError, UnitPlan

# tiny(): vision (2 layers, 2 heads, ffn 64) -> llm (4 layers, 4 heads, 2 kv heads, ffn 128,
# vocab 512) -> generator (2 layers, 2 heads, ffn 64)
CFG = tiny()


def plan_with(cfg=CFG, global_batch=8, num_microbatches=2, **per_unit) -> Plan:
    """A valid 1-device-per-unit plan, with per-unit field overrides: llm={"tp": 2}."""
    units = []
    for name in cfg.unit_names:
        kw = dict(per_unit.get(name, {}))
        pp, v = kw.get("pp", 1), kw.get("num_chunks", 1)
        if pp * v <= cfg.num_layers(name):
            kw.setdefault("layers", Plan.even_layers(cfg.num_layers(name), pp * v))
        kw.setdefault("frozen", cfg.frozen(name))
        units.append(UnitPlan(name=name, **kw))
    return Plan(tuple(units), global_batch, num_microbatches)


def test_valid_plan_passes_and_returns_itself():
    p = plan_with(llm={"tp": 2, "pp": 2})
    assert p.validate(CFG, 8) is p


def test_more_devices_than_exist():
    p = plan_with(llm={"tp": 2, "pp": 2}, vision={"dp": 2})  # 2 + 4 + 1 = 7 devices
    p.validate(CFG, 7)
    with pytest.raises(PlanError, match=r"needs 7 devices .* only 6 exist: lower dp/tp/pp, or "
                                     r"on CPU force host devices with XLA_FLAGS="
                                     r"--xla_force_host_platform_device_count=7"):
        p.validate(CFG, 6)


def test_unknown_unit():
    p = plan_with()
    p = dataclasses.replace(p, units=p.units + (UnitPlan("video", layers=(1,)),))
    with pytest.raises(PlanError, match=r"Plan.units: unknown unit 'video'.*rename or remove"):
        p.validate(CFG, 8)


def test_missing_llm():
    p = plan_with()
    p = dataclasses.replace(p, units=tuple(u for u in p.units if u.name != "llm"))
    with pytest.raises(PlanError, match=r"Plan.units: no entry for \['llm'\]; add a UnitPlan"):
        p.validate(CFG, 8)


def test_duplicate_unit():
    p = plan_with()
    p = dataclasses.replace(p, units=p.units + (p.unit("llm"),))
    with pytest.raises(PlanError, match="duplicate unit names"):
        p.validate(CFG, 8)


def test_global_batch_not_divisible_by_microbatches():
    with pytest.raises(PlanError, match=r"global_batch=9 is not divisible by "
                                        r"num_microbatches=2: pick a divisor"):
        plan_with(global_batch=9).validate(CFG, 8)


def test_dp_does_not_divide_microbatch():
    p = plan_with(global_batch=6, num_microbatches=2, vision={"dp": 2})  # microbatch of 3
    with pytest.raises(PlanError, match=r"unit\['vision'\].dp=2 does not divide the "
                                        r"microbatch size 3.*choose dp dividing 3"):
        p.validate(CFG, 8)


def test_fewer_layers_than_stages():
    p = plan_with(generator={"pp": 3, "layers": (1, 1, 1)})  # generator has 2 layers
    with pytest.raises(PlanError, match=r"unit\['generator'\]: 2 layers cannot fill "
                                        r"pp\*num_chunks=3 stages: lower pp or num_chunks"):
        p.validate(CFG, 8)
    p = plan_with(llm={"pp": 2, "num_chunks": 3, "layers": (1,) * 6})  # llm has 4 layers
    with pytest.raises(PlanError, match=r"4 layers cannot fill pp\*num_chunks=6"):
        p.validate(CFG, 8)


def test_layer_split_must_cover_the_unit():
    p = plan_with(llm={"pp": 2, "layers": (1, 2)})
    with pytest.raises(PlanError, match=r"unit\['llm'\].layers=\(1, 2\) must have "
                                        r"pp\*num_chunks=2 positive entries summing to 4"):
        p.validate(CFG, 8)


def test_interleaved_needs_microbatches_multiple_of_pp():
    p = plan_with(global_batch=6, num_microbatches=3, llm={"pp": 2, "num_chunks": 2})
    with pytest.raises(PlanError, match=r"interleaved 1F1B needs num_microbatches \(3\) "
                                        r"to be a multiple of pp=2"):
        p.validate(CFG, 8)


def test_sizes_must_be_positive():
    with pytest.raises(PlanError, match=r"unit\['llm'\].tp=0 must be >= 1"):
        plan_with(llm={"tp": 0}).validate(CFG, 8)


@pytest.mark.parametrize("unit,tp,overrides,what", [
    ("llm", 3, {}, r"llm.num_heads=4"),
    ("llm", 4, {}, r"llm.num_kv_heads=2"),
    ("llm", 2, {"llm.ffn_size": 129}, r"llm.ffn_size=129"),
    ("llm", 2, {"llm.vocab_size": 513}, r"llm.vocab_size=513"),
    ("vision", 4, {}, r"vision.num_heads=2"),
    ("generator", 2, {"generator.ffn_size": 65},
     r"generator.ffn_size=65"),
])
def test_tp_must_divide_sharded_sizes(unit, tp, overrides, what):
    cfg = with_overrides(tiny(), overrides)
    p = plan_with(cfg, **{unit: {"tp": tp}})
    with pytest.raises(PlanError, match=rf"unit\['{unit}'\].tp={tp} does not divide {what}: "
                                        r"choose tp dividing"):
        p.validate(cfg, 8)


def test_vocab_message_names_the_padding_fix():
    cfg = with_overrides(tiny(), {"llm.vocab_size": 511})
    with pytest.raises(PlanError, match="choose tp dividing 511 or pad the vocabulary"):
        plan_with(cfg, llm={"tp": 2}).validate(cfg, 8)


def test_overlap_tp_and_cp_rules():
    with pytest.raises(PlanError, match=r"overlap_tp=True needs the llm unit with tp >= 2"):
        plan_with(llm={"overlap_tp": True}).validate(CFG, 8)
    with pytest.raises(PlanError, match=r"unit\['vision'\].cp=2: context parallelism is "
                                        "for the llm only"):
        plan_with(vision={"cp": 2}).validate(CFG, 8)


def test_attention_impl_field_validated_and_round_trips():
    p = plan_with(llm={"attention_impl": "pallas"}, vision={"attention_impl": "chunked"})
    p.validate(CFG, 8)
    q = Plan.from_json(p.to_json())
    assert q.unit("llm").attention_impl == "pallas" and q.unit("vision").attention_impl == "chunked"
    assert q.unit("generator").attention_impl == "auto"
    with pytest.raises(PlanError, match=r"unit\['llm'\].attention_impl='flash': must be one of"):
        plan_with(llm={"attention_impl": "flash"}).validate(CFG, 8)
    with pytest.raises(PlanError, match="cuDNN runs only plain causal or full masks"):
        plan_with(vision={"attention_impl": "cudnn"}).validate(CFG, 8)
    plan_with(generator={"attention_impl": "cudnn"}).validate(CFG, 8)  # full masks: allowed
    with pytest.raises(PlanError, match="overlap_tp=True runs attention inside"):
        plan_with(llm={"tp": 2, "overlap_tp": True, "attention_impl": "pallas"}).validate(CFG, 8)


def test_json_round_trip(tmp_path):
    p = plan_with(tiny_valm(), vision={"dp": 2}, llm={"tp": 2, "pp": 2, "num_chunks": 2},
                  audio={"frozen": True})
    p = dataclasses.replace(p, kind="manual", predicted={"iteration_time": 1.5})
    q = Plan.from_json(p.to_json())
    assert q == p and q.units == p.units and q.kind == "manual"
    assert q.predicted == {"iteration_time": 1.5}
    assert all(isinstance(u.layers, tuple) for u in q.units)
    path = str(tmp_path / "plan.json")
    p.save(path)
    assert Plan.load(path) == p
    bad = p.to_json()
    bad["units"][0]["dpp"] = 2
    with pytest.raises(PlanError, match=r"unknown fields \['dpp'\]"):
        Plan.from_json(bad)


def test_rigid_plan_structure():
    cfg = tiny_valm()
    p = Plan.rigid(cfg, dp=2, tp=2, pp=2, global_batch=8, num_microbatches=2)
    assert p.kind == "rigid" and p.unit_names == ("vision", "audio", "llm")
    assert [(u.name, u.dp, u.tp, u.pp, u.layers, u.num_chunks) for u in p.units] == [
        ("vision", 2, 2, 1, (2,), 1), ("audio", 2, 2, 1, (2,), 1), ("llm", 2, 2, 2, (2, 2), 1)]
    assert p.num_devices == 4 + 4 + 8
    assert p.stage_devices() == {"vision": [list(range(0, 4))], "audio": [list(range(4, 8))],
                                 "llm": [list(range(8, 12)), list(range(12, 16))]}
    p.validate(cfg, 16)
    frozen = with_overrides(cfg, {"encoders.audio.frozen": True})
    assert [u.frozen for u in Plan.rigid(frozen, 1, 1, 1, 4, 2).units] == [False, True, False]

