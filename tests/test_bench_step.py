"""scripts/bench_step.py at tiny sizes: the step trains, and its FLOP count, MFU and planner
prediction are the formulas they claim (no wall-clock assertions)."""
import importlib.util
import json
import math
import os

import pytest

from mmjax.errors import UserError
from mmjax.data.batch_shapes import grow_shapes
from mmjax.planner.costs import unit_costs
from mmjax.planner.measured_hardware import hardware_from_profile
from mmjax.planner.workload import workload_from_metas
from mmjax.train.single_data import LoaderBatches

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_step.py")
_spec = importlib.util.spec_from_file_location("bench_step_script", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_step.json"
    rec = bench.main(["--steps", "2", "--warmup", "1", "--override", "llm.num_layers=1",
                      "--json", str(out)])
    with open(out) as fh:
        assert json.load(fh).keys() == rec.keys()
    return rec


def test_formulas(record):
    r = record
    assert r["args"]["override"] == ["llm.num_layers=1"]
    assert len(r["step_times_s"]) == 2 and len(r["losses"]) == 3
    assert all(math.isfinite(x) for x in r["losses"])
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / r["step_time_s"]
                                     / r["peak_flops"])
    assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_time_s"])
    # one static shape over the timed steps: the mean fill is mean tokens / the slots
    assert 0 < r["llm_fill"] <= 1
    assert r["llm_fill"] == pytest.approx(r["tokens_per_step"] / r["llm_slots_per_step"])
    # the planner's model FLOPs and time for the samples the run's 3 global batches held
    # (the loader's selection), recomputed here
    cfg = bench.named_model_config("tiny", {"llm.num_layers": 1})
    source = bench.SyntheticSource(bench.synthetic_dataset(cfg))
    layout = bench.data_layout(cfg, seq_len=256, packing="pack")
    data = LoaderBatches.from_gin(source, layout, 8, lambda s, m: grow_shapes(s, m, layout))
    metas = [m for _, _, ms in data.stream.scan(3) for m in ms.metas()]
    assert len(metas) == 3 * 8
    wl = workload_from_metas("bench batches", metas, cfg)
    # priced by the CPU's measured profile (recorded), never by a GPU's spec
    hw = hardware_from_profile(r["hardware_profile"], "float32", r["tokens_per_step"])
    costs = unit_costs(cfg, wl, hw, recompute=False)
    assert r["model_flops_per_step"] == pytest.approx(8 * sum(c.flops for c in costs))
    assert r["predicted_step_s"] == pytest.approx(8 * sum(c.time_s[1] for c in costs))
    assert set(r["predicted_unit_s"]) == {"vision", "llm", "generator"}
    # XLA's count of the compiled step covers at least the forward's share of the model's
    assert r["xla_flops_per_step"] > r["model_flops_per_step"] / 3


def test_a_cpu_run_is_priced_by_the_cpu_it_measured(record, capsys):
    """MFU is of the CPU's measured float32 matmul peak, the prediction on the measured CPU,
    and the table says so (not "MFU (of 989 TFLOP/s)")."""
    prof = record["hardware_profile"]
    assert prof["device"] == record["device"] == "cpu" and prof["platform"] == "cpu"
    assert record["peak_flops"] == prof["matmul_peak_flops"]["float32"]
    assert record["peak_measured"] is True
    assert record["hardware_model"] == "measured cpu"
    assert prof["memory_bw"] > 0 and prof["device_count"] == len(bench.jax.devices())
    # XLA's dense attention per (query, key, head) pair, the host's cores and one device's
    assert prof["dense_attention_pair_s"] > 0 and prof["cpu_cores"] >= 1
    assert prof["device_busy_cores"] > 0
    assert len(record["step_cpu_s"]) == len(record["step_times_s"])
    bench.show(bench.Console(width=120), record)
    out = capsys.readouterr().out
    assert f"MFU (of {record['peak_flops'] / 1e9:,.1f} GFLOP/s measured)" in out
    assert "989" not in out


def test_a_given_profile_is_used_and_must_be_this_device(tmp_path):
    mine = {"device": "cpu", "matmul_peak_flops": {"float32": 5e10}, "memory_bw": 1e10,
            "collective_bw": 2e9, "device_count": 8, "memory_bytes": 1e10, "points": []}
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(mine))
    assert bench.device_profile(str(path)) == mine  # measured already: nothing re-measured
    hw = hardware_from_profile(mine, "float32")
    assert (hw.peak_flops, hw.hbm_bw, hw.nvlink_bw, hw.nic_bw, hw.gpus_per_node) == \
        (5e10, 1e10, 2e9, 2e9, 8)
    other = dict(mine, device="NVIDIA H100 80GB HBM3")
    path.write_text(json.dumps(other))
    with pytest.raises(UserError, match="measured on 'NVIDIA H100 80GB HBM3'.*on 'cpu'"):
        bench.device_profile(str(path))


def test_recount_reproduces_the_record(record, tmp_path):
    """--recount rebuilds the same batches from the record's arguments alone (no model)."""
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(record))
    again = bench.recount(str(path))
    for key in ("model_flops_per_step", "mfu", "predicted_step_s", "step_model_s"):
        assert again[key] == pytest.approx(record[key], rel=1e-12)
    assert again["recounted"] is True


def test_the_profile_is_measured_beside_the_timed_steps(record, tmp_path):
    """Without --profile the probes run after every timed step (the steps' own load): the
    record's profile is their wall-second medians, and the step's CPU time is priced by the
    same probes per CPU second - the step model on that profile, recomputed here."""
    prof, cpu = record["hardware_profile"], record["cpu_profile"]
    assert prof["basis"] == "wall" and cpu["basis"] == "cpu"
    assert prof["measured_beside_steps"] == cpu["measured_beside_steps"] == 2
    assert prof["matmul_half_width"] >= 0 and cpu["memory_bw"] > 0
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(dict(record, hardware_profile=cpu)))
    assert bench.recount(str(path))["step_model_s"] == pytest.approx(
        record["step_model_cpu_s"], rel=1e-12)
    parts = record["step_model_cpu_parts_s"]
    assert {"llm compute", "llm elementwise", "AdamW", "loss head"} <= set(parts)
    assert sum(parts.values()) == pytest.approx(record["step_model_cpu_s"])


def test_bad_override_is_a_user_error():
    with pytest.raises(Exception, match="llm.no_such_field"):
        bench.main(["--override", "llm.no_such_field=1", "--json", os.devnull])


def test_memory_fields_are_the_compiled_account(record):
    m = record["memory"]
    assert m["compiled_peak"] == (m["arguments"] + m["outputs"] - m["aliased"]
                                  + m["temporaries"])
    assert m["aliased"] > 0  # the old state is donated
    assert m["device_peak"] is None  # CPU reports no allocator statistics


@pytest.mark.slow
def test_colocated_zero3_step_trains_the_same_losses_in_an_eighth_of_the_state(record,
                                                                              tmp_path):
    """`--colocated_zero 3`: the co-located runner over the 8 test devices, every unit at
    ZeRO-3, trains the single program's losses on the same batches, and its compiled step
    holds less per device (the state sharded 8 ways)."""
    rec = bench.main(["--steps", "2", "--warmup", "1", "--override", "llm.num_layers=1",
                      "--colocated_zero", "3", "--json", str(tmp_path / "colo.json")])
    assert rec["args"]["colocated_zero"] == 3
    assert rec["losses"] == pytest.approx(record["losses"], rel=1e-5)
    assert rec["trainable_params"] == record["trainable_params"]
    # the donated state (master, m, v: 12 bytes per parameter) is sharded 8 ways
    assert record["memory"]["aliased"] >= 12 * record["trainable_params"]
    assert rec["memory"]["aliased"] == pytest.approx(record["memory"]["aliased"] / 8,
                                                     rel=0.01)
    assert rec["memory"]["compiled_peak"] < record["memory"]["compiled_peak"]


def test_dense_slots_where_xla_dense_attention_runs():
    """The step model prices static shapes where attention is XLA's dense path: "auto" on a
    CPU up to models/attention.py's pair limit, or "dense" anywhere; tiled kernels not."""
    from types import SimpleNamespace as NS

    shapes = NS(rows=5, encoders=(("vision", 2, 256),))
    cpu, gpu = {"platform": "cpu"}, {"platform": "gpu"}
    assert bench.dense_slots(NS(attention="auto", seq_len=256), shapes, cpu) == \
        bench.SlotShapes(5, 256, {"vision": (2, 256)})
    assert bench.dense_slots(NS(attention="auto", seq_len=256), shapes, gpu) is None
    assert bench.dense_slots(NS(attention="dense", seq_len=256), shapes, gpu) is not None
    assert bench.dense_slots(NS(attention="auto", seq_len=1024), shapes, cpu) is None


@pytest.mark.slow
def test_lora_run_reports_its_optimizer_memory_against_training_whole(record, tmp_path, capsys):
    """`--lora 4`: the LLM's base frozen; the record and the table give the LoRA run's and
    the whole model's trained parameters, master + AdamW and gradient bytes, and the memory
    model's state for both; the whole model's count is the plain run's."""
    rec = bench.main(["--steps", "2", "--warmup", "1", "--override", "llm.num_layers=1",
                      "--lora", "4", "--json", str(tmp_path / "lora.json")])
    lora, whole = rec["trained_whole"]["lora"], rec["trained_whole"]["whole"]
    assert whole["trainable_params"] == record["trainable_params"]
    assert lora["trainable_params"] == rec["trainable_params"] < whole["trainable_params"]
    for w in (lora, whole):
        assert (w["optimizer_bytes"], w["gradient_bytes"]) == (12 * w["trainable_params"],
                                                               4 * w["trainable_params"])
    assert lora["model_state_bytes"] < whole["model_state_bytes"]
    # the compiled step's donated state (master + AdamW) shrinks with what trains
    assert rec["memory"]["aliased"] < record["memory"]["aliased"]
    out = capsys.readouterr().out
    assert "LoRA: params" in out and "trained whole: params" in out
