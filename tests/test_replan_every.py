"""`train.replan_every` (train/replanning.py): the run re-plans from its measured step times
(DistTrain §5 on the measured profile) and, when the predicted gain is high enough,
continues under the new plan from a plan-independent checkpoint."""
import json
import os
import re
import shutil
import subprocess
import sys

import gin
import numpy as np
import pytest

import mmjax.data.loader  # noqa: F401  (registers Loader with gin)
from mmjax.data.data_spec import sample_workload
from mmjax.errors import UserError
from mmjax.models.config import with_overrides
from mmjax.models.tiny import tiny
from mmjax.planner.build import model_costs
from mmjax.planner.hardware import H100
from mmjax.planner.measured import predicted_actions
from mmjax.planner.plan import Plan
from mmjax.train.data_config import train_source
from mmjax.train.plan_history import plan_in_effect, write_plan
from mmjax.train.replanning import (Replanner, decision_from_json, decision_json,
                                    from_process_0)
from mmjax.train.trainer import train

sys.path.insert(0, os.path.dirname(__file__))
from test_replan import synthetic_trace  # noqa: E402


def small_tiny():
    return with_overrides(tiny(), {"llm.num_layers": 2, "encoders.vision.encoder.num_layers": 1,
                                   "generator.num_layers": 1})


def plan_a(cfg):
    """Six of the eight devices, the vision encoder on one, no recomputation (what the
    planner picks for this small model): near the planner's own plan for the analytic
    costs (predicted gain ~1.06 on 8 devices)."""
    return Plan.uniform(cfg, 4, 2, dp={"llm": 2}, pp={"llm": 2}, remat="none")


@pytest.fixture(scope="module")
def setting():
    cfg = small_tiny()
    wl = sample_workload(train_source(cfg), cfg, 256)
    return cfg, wl, model_costs(cfg, H100, wl)[1]


class SlowUnit(Replanner):
    """A machine on which the analytic model is exact except that `unit` runs 10x slower:
    every traced action (the runtime's own actions) takes its analytic time, x10 for
    `unit`, so the decision does not hang on this CPU's timings."""

    def __init__(self, *args, unit: str, **kw):
        super().__init__(*args, **kw)
        self.unit = unit

    def measured_trace(self, plan, trace):
        pred = predicted_actions(plan, model_costs(self.model, self.hardware,
                                                   self.workload)[1])
        out, t = [], 0.0
        for d in trace:
            stage = d.get("virtual_stage", d["stage"])
            dur = pred[(stage, d["kind"])] * (10.0 if stage.startswith(self.unit + ":")
                                              else 1.0)
            out.append({**d, "start": t, "end": t + dur})
            t += dur
        return out


def test_a_slowed_unit_switches_plans_an_unslowed_run_does_not(setting):
    cfg, wl, layer_costs = setting
    a = plan_a(cfg)
    replanner = Replanner(cfg, H100, wl, 8, min_gain=1.10)
    assert replanner.decide(a, synthetic_trace(a, layer_costs, {})) is None
    new, gain = replanner.decide(a, synthetic_trace(a, layer_costs, {"vision": 10.0}))
    print(f"vision devices {a.unit('vision').num_devices} -> "
          f"{new.unit('vision').num_devices}, predicted gain {gain:.3f}")
    assert new.unit("vision").num_devices > a.unit("vision").num_devices
    assert gain >= 1.10
    new.validate(cfg, 8)
    # process 0's decision as every process receives it (single process: unchanged)
    text = decision_json((new, gain))
    assert from_process_0(text) == text and from_process_0(None) is None
    back, g = decision_from_json(text)
    assert back.to_json() == new.to_json() and g == gain


def test_the_plan_in_effect_is_the_newest_at_or_before_the_step(tmp_path, setting):
    cfg = setting[0]
    assert plan_in_effect(str(tmp_path), 10) is None
    assert write_plan(str(tmp_path), 4, plan_a(cfg)) == os.path.join("plans", "step_4.json")
    write_plan(str(tmp_path), 8, plan_a(cfg))
    assert plan_in_effect(str(tmp_path), 3) is None
    assert plan_in_effect(str(tmp_path), 7) == (4, str(tmp_path / "plans" / "step_4.json"))
    assert plan_in_effect(str(tmp_path), 8)[0] == 8


@pytest.mark.parametrize("kw, match", [
    ({"plan": None, "replan_every": 4}, r"train.replan_every .*add --plan=auto or a plan JSON"),
    ({"plan": "auto", "replan_every": -1}, r"train.replan_every=-1: must be an int >= 0"),
    ({"plan": "auto", "replan_every": 4, "replan_min_gain": 1.0}, r"replan_min_gain=1.0: must"),
    ({"plan": "auto", "replan_every": 4, "replan_min_gain": "x"}, r"replan_min_gain='x'"),
    ({"plan": "auto", "replanner": object()}, r"set train.replan_every=N"),
])
def test_replan_settings_are_checked_before_any_work(tmp_path, kw, match):
    with pytest.raises(UserError) as e:
        train(str(tmp_path / "run"), **kw)
    assert re.search(match, str(e.value).splitlines()[0])  # gin appends lines after it
    assert not (tmp_path / "run").exists()


def test_a_replanner_rejects_a_min_gain_of_at_most_one(setting):
    with pytest.raises(UserError, match="must be a number > 1"):
        Replanner(setting[0], H100, setting[1], 8, min_gain=0.9)


@pytest.mark.slow  # three short trainers on the tiny model; plan A/B programs cached
def test_a_run_switches_to_the_plan_that_feeds_a_slow_unit_and_resumes_on_it(
        tmp_path, setting, capsys):
    cfg, wl, _ = setting
    a = plan_a(cfg)
    path_a = str(tmp_path / "plan_a.json")
    a.save(path_a)
    with gin.unlock_config():
        gin.parse_config(["Loader.reserve = 4", "Loader.seed = 5",
                          "data_layout.seq_len = 128"])
    slow = lambda: SlowUnit(cfg, H100, wl, 8, min_gain=1.10, unit="vision")
    try:
        run = lambda name, **kw: train(str(tmp_path / name), model=cfg, global_batch=4,
                                       progress=False, plan=path_a, checkpoint_every=100,
                                       **kw)
        straight = run("straight", steps=8)
        switched = run("switched", steps=8, replan_every=4, replanner=slow())
        work = tmp_path / "switched"
        b = Plan.load(str(work / "plans" / "step_4.json"))
        plans_after_8 = sorted(os.listdir(work / "plans"))
        capsys.readouterr()
        # the rerun: more steps, the replanner train builds (real CPU timings) that only
        # a 100x predicted gain (the setting's largest) would move
        resumed = run("switched", steps=12, replan_every=4, replan_min_gain=100.0)
        said = capsys.readouterr().err
        plans_after_12 = sorted(os.listdir(work / "plans"))
        with open(work / "run.json") as f:
            run_plan_12 = Plan.from_json(json.load(f)["plan"])
        # every checkpoint damaged: the run starts afresh on the plan it started with
        for step in os.listdir(tmp_path / "switched" / "checkpoints"):
            shutil.rmtree(tmp_path / "switched" / "checkpoints" / step / "integrity")
        afresh = run("switched", steps=12, stop_after=1)
        said_afresh = capsys.readouterr().err
    finally:
        gin.clear_config()
    assert [r["step"] for r in switched] == list(range(1, 9))
    assert [("replanned" in r) for r in switched] == [i == 4 for i in range(1, 9)]
    mark = switched[3]["replanned"]
    assert mark["plan"] == os.path.join("plans", "step_4.json") and mark["gain"] >= 1.10
    assert b.unit("vision").num_devices > a.unit("vision").num_devices
    assert plans_after_8 == ["step_4.json"]  # step 8: B stays
    # steps 5..8 ran on plan B from step 4's checkpoint: the plan-A run's losses
    np.testing.assert_allclose([r["loss"] for r in switched], [r["loss"] for r in straight],
                               rtol=1e-5)
    # the rerun continues on plan B, and says so
    assert [r["step"] for r in resumed] == [9, 10, 11, 12]
    assert not any("replanned" in r for r in resumed)
    assert plans_after_12 == ["step_4.json"]
    assert f"resuming on {work / 'plans' / 'step_4.json'}" in said
    assert run_plan_12.to_json() == b.to_json()
    assert f"no usable checkpoint: starting on {path_a}" in said_afresh
    assert not os.listdir(work / "plans")
    np.testing.assert_allclose(afresh[0]["loss"], straight[0]["loss"], rtol=1e-5)
    with open(work / "run.json") as f:
        assert Plan.from_json(json.load(f)["plan"]).to_json() == a.to_json()


_BROADCAST = """
import jax
from mmjax.train.replanning import from_process_0
p = jax.process_index()
print("GOT", from_process_0(f"plan of process {p}"), from_process_0(None if p == 0 else "x"),
      flush=True)
"""


@pytest.mark.slow
def test_every_process_takes_process_0s_decision(tmp_path, gloo_jobs):
    script = tmp_path / "broadcast.py"
    script.write_text(_BROADCAST)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, os.path.join(root, "scripts", "launch_local.py"),
                          "--num_processes=2", "--devices_per_process=1",
                          f"--script={script}"], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    for p in (0, 1):
        assert f"[p{p}] GOT plan of process 0 None" in res.stdout, res.stdout[-2000:]


def test_replanning_plans_for_the_hardware_and_data_start_up_planning_does(setting):
    from mmjax.planner.hardware import A800
    from mmjax.train.auto_plan import device_hardware, run_planning_inputs

    cfg = setting[0]
    hw, wl = run_planning_inputs(cfg, train_source(cfg))
    # the devices' hardware and 256 samples of the source, as auto_plan
    assert hw == device_hardware() and wl.llm_tokens == setting[1].llm_tokens
    with gin.unlock_config():
        gin.parse_config(["auto_plan.hardware_name = 'a800'", "auto_plan.data_samples = 16"])
    try:
        hw, wl = run_planning_inputs(cfg, train_source(cfg))
    finally:
        gin.clear_config()
    assert hw == A800 and len(wl.llm_tokens) == 16


def test_a_resume_forgets_the_plans_its_checkpoint_predates(tmp_path, setting):
    from mmjax.train.plan_history import forget_plans_after

    for k in (4, 8, 12):
        write_plan(str(tmp_path), k, plan_a(setting[0]))
    forget_plans_after(str(tmp_path), 8)
    assert sorted(os.listdir(tmp_path / "plans")) == ["step_4.json", "step_8.json"]


def test_replan_script_reads_the_traces_of_the_newest_plan(tmp_path, setting):
    cfg, _, layer_costs = setting
    a = plan_a(cfg)
    b = Plan.uniform(cfg, 4, 2, dp={"vision": 2, "llm": 2}, pp={"llm": 2})
    (tmp_path / "traces").mkdir()
    for step, plan in ((4, a), (8, b), (12, b), (100, a), (110, b)):  # 110 after 100, not 12
        with open(tmp_path / "traces" / f"step_{step}.json", "w") as f:
            json.dump({"model": cfg.name, "plan": plan.to_json(),
                       "trace": synthetic_trace(plan, layer_costs, {"vision": step})}, f)
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "scripts"))
    import replan as replan_cli

    name, plan, trace, compiled, device = replan_cli.load_traces(str(tmp_path))
    assert plan.to_json() == b.to_json()
    per_step = len(synthetic_trace(b, layer_costs, {}))
    assert len(trace) == 3 * per_step and compiled == []
    assert device is None  # these traces do not name their device (as before issue 40)
