"""The co-located layout's cost and memory model (planner/colocated.py), Cornstarch's
co-located baseline (planner/cornstarch_colocated.py) and `plan.py --layout` (no JAX)."""
import json
import os
import subprocess
import sys

import pytest

from mmjax.planner.plan import PlanError
from mmjax.models.named import named_config
from mmjax.planner.build import model_costs, plan_model
from mmjax.planner.colocated import (_a2a_bw, best_colocated, compute_copy_bytes,
                                     evaluate_colocated, gather_bytes, state_bytes,
                                     tp_choices, unit_params)
from mmjax.planner.cornstarch_colocated import cornstarch_colocated
from mmjax.planner.evaluate import Choice, stage_time
from mmjax.planner.hardware import A800, H100
from mmjax.planner.layout_choice import choose_layout, slowest_stage_busy_s

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


@pytest.fixture(scope="module")
def costs_10b():
    return model_costs(named_config("orchmllm/mllm_10b"), H100)[0]


def test_zero_stages_shard_state(costs_10b):
    """Stage 1 at dp 1 is the replicated figure (float32 parameters and gradients, AdamW's
    m and v, float32 frozen parameters: 16 P + 4 F); stage 3 at dp d is exactly 1/d of it
    plus two layers' gathered weights; stage 2 sits between them. The compute-dtype copy
    is extra at stages 1-2 only."""
    for c in costs_10b:
        t, f = unit_params(c)
        assert t * 12 == pytest.approx(c.optimizer_bytes)
        rep = state_bytes(c, 1, 1, 1)
        assert rep == pytest.approx(16 * t + 4 * f, rel=1e-12)
        assert compute_copy_bytes(c, 1, 1) == pytest.approx(c.dtype_bytes * (t + f))
        assert compute_copy_bytes(c, 1, 3) == 0.0
        two_layers = 2 * 4 * (t + f) / c.num_layers
        for d in (8, 64):
            z3 = state_bytes(c, 1, d, 3)
            assert z3 - two_layers == pytest.approx(rep / d, rel=1e-12)
            assert z3 < state_bytes(c, 1, d, 2) < state_bytes(c, 1, d, 1)
    with pytest.raises(PlanError, match="zero_stage=4"):
        state_bytes(costs_10b[0], 1, 8, 4)


def test_zero3_gathers_hide_behind_compute(costs_10b):
    """ZeRO-3 exposes max(0, traffic - compute) + one layer's gather per micro-step; more
    micro-steps repeat the gathers."""
    tp = {"vision": 1, "audio": 1, "llm": 4}
    zero = {"vision": 3, "audio": 3, "llm": 3}
    one = evaluate_colocated(costs_10b, 64, 256, H100, tp, zero, "none", 1)
    two = evaluate_colocated(costs_10b, 64, 256, H100, tp, zero, "none", 2)
    llm = next(c for c in costs_10b if c.name == "llm")
    traffic = gather_bytes(llm, 4, 16) / H100.group_bw(64)
    expect = max(0.0, traffic - one.compute_s["llm"]) + traffic / llm.num_layers
    assert one.exposed_comm_s["llm"] == pytest.approx(expect, rel=1e-12)
    assert two.exposed_comm_s["llm"] > one.exposed_comm_s["llm"]
    assert two.memory_gb < one.memory_gb
    with pytest.raises(PlanError, match="tp=3 is not valid"):
        evaluate_colocated(costs_10b, 64, 256, H100, {"llm": 3}, zero)


def test_encoder_tp_is_priced(costs_10b):
    """An encoder's tp: its state is one tp rank's share at dp G/tp, its compute the cost's
    time at that tp over G/tp ranks, its all-to-all the rows every LLM tp replica receives
    forward and every own tp replica receives back; the search nests the sizes and takes
    encoder tp where it pays (OrchMLLM's 10B on 64 H100s: it hides the encoders' syncs)."""
    zero = {"vision": 3, "audio": 1, "llm": 3}
    base = {"vision": 1, "audio": 1, "llm": 4}
    one = evaluate_colocated(costs_10b, 64, 256, H100, base, zero, "none", 1)
    two = evaluate_colocated(costs_10b, 64, 256, H100, {**base, "vision": 2}, zero, "none", 1)
    vis = next(c for c in costs_10b if c.name == "vision")
    assert two.compute_s["vision"] == pytest.approx(256 / 32 * vis.time_s[2], rel=1e-12)
    assert state_bytes(vis, 2, 32, 3) < state_bytes(vis, 1, 64, 3) * 1.01
    a2a = lambda tp: sum((tp["llm"] + tp[c.name]) * 256 / 64 * c.boundary_bytes * 63 / 64
                         / _a2a_bw(H100, 64) for c in costs_10b if c.name != "llm")
    assert one.all_to_all_s == pytest.approx(a2a(base), rel=1e-12)
    assert two.all_to_all_s == pytest.approx(a2a({**base, "vision": 2}), rel=1e-12)
    assert two.memory_gb != one.memory_gb
    choices = tp_choices(costs_10b, 64)
    assert {"vision": 8, "audio": 2, "llm": 4} in choices and len(choices) == len(
        {tuple(sorted(c.items())) for c in choices})
    for c in choices:
        sizes = sorted(set(c.values()))
        assert all(b % a == 0 for a, b in zip(sizes, sizes[1:]))
    best = best_colocated(costs_10b, 64, 256, H100)
    assert best.tp["vision"] > 1
    llm_only = evaluate_colocated(costs_10b, 64, 256, H100,
                                  {**best.tp, "vision": 1, "audio": 1}, best.zero, best.remat,
                                  best.micro_steps)
    assert best.iteration_time_s < llm_only.iteration_time_s


def test_pruned_search_is_exhaustive(costs_10b):
    """The bound-pruned search returns the fastest fitting choice of the whole space (every
    nested tp, ZeRO stage and remat, one micro-step)."""
    import itertools

    from mmjax.planner.memory import REMATS

    names = [c.name for c in costs_10b]
    best = best_colocated(costs_10b, 64, 256, H100, max_micro_steps=1)
    times = []
    for tp in tp_choices(costs_10b, 64):
        for zs in itertools.product((1, 2, 3), repeat=len(names)):
            for r in REMATS:
                ev = evaluate_colocated(costs_10b, 64, 256, H100, tp, dict(zip(names, zs)), r)
                if not ev.notes:
                    times.append(ev.iteration_time_s)
    assert best.iteration_time_s == min(times)


def test_cornstarch_baseline_puts_encoders_on_the_first_stage(costs_10b):
    cs = cornstarch_colocated(costs_10b, H100, 64, 256)
    ch = cs.llm
    assert ch.tp * ch.pp * ch.dp == 64
    encs = [c for c in costs_10b if c.name != "llm"]
    extra = sum(stage_time(c, Choice(max(t for t in c.time_s if t <= ch.tp), ch.dp, 1),
                           ch.dp) for c in encs)
    if ch.pp > 1:
        assert cs.stage_time_s["first"] - cs.stage_time_s["llm"] == pytest.approx(extra)
    assert cs.iteration_time_s > 0 and cs.memory_gb * 1e9 <= H100.hbm_bytes


def test_auto_picks_each_layout_for_a_named_config():
    """A small VLM on one 8-GPU node: co-located (no pipeline warm-up, every GPU on every
    phase). OrchMLLM's 10B on 64 H100s: disaggregated (co-located exposes the encoders'
    gradient syncs over the NIC and runs phases one after another)."""
    picks = {}
    for name, gpus, batch, hw in (("cornstarch/vlm_s", 8, 64, A800),
                                  ("orchmllm/mllm_10b", 64, 256, H100)):
        model = named_config(name)
        costs = model_costs(model, hw)[0]
        colo = best_colocated(costs, gpus, batch, hw)
        plan = plan_model(model, hw, gpus, batch)
        dis = plan.predicted
        pick = choose_layout(colo, dis["iteration_time_s"], slowest_stage_busy_s(plan))
        assert pick.colocated_s == colo.iteration_time_s
        assert f"{colo.iteration_time_s:.3f}" in pick.reason
        assert f"{dis['iteration_time_s']:.3f}" in pick.reason
        assert pick.reason.rstrip()[-1] in "0123456789s)"  # a whole sentence, ending in a time
        picks[name] = pick.layout
    assert picks == {"cornstarch/vlm_s": "colocated", "orchmllm/mllm_10b": "disaggregated"}


@pytest.mark.slow
def test_plan_cli_layout_auto(tmp_path):
    out = tmp_path / "auto.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"),
                        "--gin_file=configs/cornstarch/vlm_s.gin", "--gpus=8",
                        "--global_batch=64", "--layout=auto", f"--json={out}"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for word in ("co-located (OrchMLLM)", "disaggregated (DistTrain)", "cornstarch-colocated",
                 "layout auto picks colocated", "ZeRO"):
        assert word in text
    d = json.loads(out.read_text())
    assert d["layout"] == "colocated"
    assert d["colocated"]["iteration_time_s"] < d["disaggregated"]["predicted"][
        "iteration_time_s"]
