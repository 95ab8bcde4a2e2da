"""Re-planning from measured times (planner/measured.py, scripts/replan.py): per-unit
factors learned from a trace with the analytic model as prior, and a slowed unit gets
more devices."""
import json
import os
import sys

import pytest

from mmjax.models.named import named_config
from mmjax.planner.build import model_costs, plan_model
from mmjax.planner.hardware import A800
from mmjax.planner.measured import predicted_actions, replan, unit_factors

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def synthetic_trace(plan, layer_costs, slow: dict[str, float]):
    """A serial trace of `plan` whose actions take the analytic time x slow[unit]."""
    trace, t = [], 0.0
    for (stage, kind), sec in predicted_actions(plan, layer_costs).items():
        unit = stage.rpartition(":")[0]
        for mb in range(plan.num_microbatches):
            d = sec * slow.get(unit, 1.0)
            trace.append({"stage": stage, "virtual_stage": stage, "kind": kind,
                          "microbatch": mb, "chunk": 0, "start": t, "end": t + d})
            t += d
    return trace


@pytest.fixture(scope="module")
def setting():
    model = named_config("disttrain/mllm_9b")
    plan = plan_model(model, A800, 98, 128)
    _, layer_costs = model_costs(model, A800)
    return model, plan, layer_costs


def test_factors_are_measured_over_analytic_shrunk_to_the_prior(setting):
    model, plan, layer_costs = setting
    trace = synthetic_trace(plan, layer_costs, {"vision": 3.0})
    f = unit_factors(plan, layer_costs, trace, prior_actions=4.0)
    n = sum(1 for d in trace if d["stage"].startswith("vision:"))
    assert f["vision"] == pytest.approx((4.0 + 3.0 * n) / (4.0 + n), rel=1e-9)
    assert f["llm"] == pytest.approx(1.0, rel=1e-9)
    one = [d for d in trace if d["stage"].startswith("vision:")][:1]
    assert unit_factors(plan, layer_costs, one, 4.0)["vision"] == pytest.approx(7 / 5)
    with pytest.raises(ValueError, match="not in the plan"):
        unit_factors(plan, layer_costs, [{**one[0], "virtual_stage": "audio:0"}])


def test_a_slowed_unit_gets_more_devices(setting):
    model, plan, layer_costs = setting
    same = replan(model, plan, synthetic_trace(plan, layer_costs, {}), A800, 98)
    assert same.gain == pytest.approx(1.0, rel=1e-6)
    slow = replan(model, plan, synthetic_trace(plan, layer_costs, {"vision": 10.0}), A800, 98)
    before = plan.unit("vision").num_devices
    after = slow.plan.unit("vision").num_devices
    print(f"vision devices {before} -> {after}, predicted gain {slow.gain:.3f}")
    assert after > before and slow.gain > 1.0
    assert slow.predicted_s <= slow.current_s
    rows = {r["stage"]: r for r in slow.stages}
    assert rows["vision:0"]["measured_s"] == pytest.approx(10 * rows["vision:0"]["predicted_s"])


def test_replan_cli_prints_measured_predicted_and_gain(setting, tmp_path, capsys):
    model, plan, layer_costs = setting
    trace = synthetic_trace(plan, layer_costs, {"vision": 10.0})  # a slow unit: a new plan
    (tmp_path / "traces").mkdir()
    with open(tmp_path / "traces" / "step_2.json", "w") as f:
        json.dump({"model": model.name, "plan": plan.to_json(), "trace": trace}, f)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import replan as replan_cli

    assert replan_cli.main([f"--workdir={tmp_path}", "--hardware=a800", "--gpus=98",
                            f"--json={tmp_path / 'new.json'}"]) == 0
    out = capsys.readouterr().out
    assert "vision:0" in out and "predicted gain" in out and "changes: " in out
    assert os.path.exists(tmp_path / "new.json")
    assert replan_cli.main([f"--workdir={tmp_path / 'nothing'}"]) == 2
    assert "error: no traces" in capsys.readouterr().out


def test_replan_cli_reads_a_trace_steps_run_and_says_no_change(setting, tmp_path, capsys):
    """`--trace_steps` also writes step_<n>.perfetto.json and .png beside each trace: they
    are not traces; the plan's own measured profile re-plans into the same plan, so the
    script says "no change" (gain 1.000x), never a gain."""
    model, plan, layer_costs = setting
    (tmp_path / "traces").mkdir()
    for n in (3, 4):
        with open(tmp_path / "traces" / f"step_{n}.json", "w") as f:
            json.dump({"model": model.name, "plan": plan.to_json(),
                       "trace": synthetic_trace(plan, layer_costs, {})}, f)
        (tmp_path / "traces" / f"step_{n}.perfetto.json").write_text("{}")
        (tmp_path / "traces" / f"step_{n}.png").write_bytes(b"")
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import replan as replan_cli

    assert replan_cli.main([f"--workdir={tmp_path}", "--hardware=a800", "--gpus=98"]) == 0
    out = capsys.readouterr().out
    assert "no change, gain 1.000x" in out and "predicted gain" not in out


def test_plan_changes_names_every_changed_setting(setting):
    import dataclasses

    from mmjax.planner.measured import plan_changes

    _, plan, _ = setting
    assert plan_changes(plan, plan) == []
    llm = plan.unit("llm")
    other = dataclasses.replace(plan, num_microbatches=plan.num_microbatches * 2, units=tuple(
        dataclasses.replace(u, remat="none" if u.remat != "none" else "full")
        if u.name == "llm" else u for u in plan.units))
    assert plan_changes(plan, other) == [
        f"microbatches {plan.num_microbatches} -> {plan.num_microbatches * 2}",
        f"llm remat {llm.remat} -> {other.unit('llm').remat}"]


def test_replan_leaves_out_traced_steps_that_compiled(setting, tmp_path, capsys):
    """A traced step in which programs compiled (the first, on any machine) times
    compilation, not the plan: replan.py leaves it out and says so; with only such steps
    it refuses, naming them."""
    model, plan, layer_costs = setting
    (tmp_path / "traces").mkdir()
    for n, slow, compiled in ((1, {"vision": 50.0}, 53), (2, {}, 0)):
        with open(tmp_path / "traces" / f"step_{n}.json", "w") as f:
            json.dump({"model": model.name, "plan": plan.to_json(), "compiled": compiled,
                       "trace": synthetic_trace(plan, layer_costs, slow)}, f)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import replan as replan_cli

    assert replan_cli.main([f"--workdir={tmp_path}", "--hardware=a800", "--gpus=98"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "left out traced steps [1]: programs compiled in them" in out
    assert "no change, gain 1.000x" in out  # the compiled step's slow vision is not learned
    (tmp_path / "traces" / "step_2.json").unlink()
    assert replan_cli.main([f"--workdir={tmp_path}", "--hardware=a800", "--gpus=98"]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "every traced step" in out and "compiled programs (steps [1])" in out


def _cpu_traces(setting, tmp_path):
    model, plan, layer_costs = setting
    (tmp_path / "traces").mkdir()
    with open(tmp_path / "traces" / "step_2.json", "w") as f:
        json.dump({"model": model.name, "plan": plan.to_json(), "compiled": 0,
                   "device": "cpu", "trace": synthetic_trace(plan, layer_costs, {})}, f)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import replan as replan_cli
    return replan_cli


def test_a_cpu_trace_is_priced_by_the_cpu_profile_never_a_gpu_spec(setting, tmp_path, capsys):
    """The trace names its device; a CPU trace is priced by the CPU's measured profile, and
    `--hardware=h100` for it (or a profile of another device) is refused."""
    replan_cli = _cpu_traces(setting, tmp_path)
    cpu = {"device": "cpu", "matmul_peak_flops": {"float32": 5e10, "bfloat16": 2e10},
           "memory_bw": 1e10, "collective_bw": 2e9, "device_count": 8, "memory_bytes": 1e10,
           "dtype": "float32", "points": []}
    prof = tmp_path / "cpu.json"
    prof.write_text(json.dumps(cpu))
    hw = replan_cli.traced_hardware("cpu", str(prof), None)
    assert (hw.name, hw.peak_flops, hw.nvlink_bw) == ("measured cpu", 5e10, 2e9)
    assert replan_cli.main([f"--workdir={tmp_path}", f"--profile={prof}", "--gpus=98"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "priced on measured cpu (the trace ran on cpu)" in out
    assert replan_cli.main([f"--workdir={tmp_path}", "--hardware=h100", "--gpus=98"]) == 2
    assert "--hardware=h100 but the trace ran on 'cpu'" in capsys.readouterr().out
    prof.write_text(json.dumps(dict(cpu, device="NVIDIA H100 80GB HBM3")))
    assert replan_cli.main([f"--workdir={tmp_path}", f"--profile={prof}", "--gpus=98"]) == 2
    assert "was measured on 'NVIDIA H100 80GB HBM3'" in capsys.readouterr().out
    # a GPU trace: its spec; a trace naming no device: --hardware as before
    assert replan_cli.traced_hardware("NVIDIA H100 80GB HBM3", None, None).name == "H100"
    assert replan_cli.traced_hardware(None, None, "a800").name == "A800"


def test_a_cpu_trace_read_on_this_cpu_measures_it(setting, tmp_path):
    replan_cli = _cpu_traces(setting, tmp_path)
    hw = replan_cli.traced_hardware("cpu", None, None)  # the test machine's devices are CPUs
    assert hw.name == "measured cpu" and hw.max_efficiency == 1.0 and hw.peak_flops > 0
