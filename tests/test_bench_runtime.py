"""scripts/bench_runtime.py smoke test at the smallest settings: the JSON has one row per plan
with the plans' units, the action count of the unit-DAG 1F1B schedule and one timed cost per
(stage, kind), and the traces rendered by scripts/timeline.py hold exactly the schedule's
actions (no wall-clock assertions)."""
import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_runtime.py")
_spec = importlib.util.spec_from_file_location("bench_runtime_script", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

M = 2  # microbatches
STAGES = ("vision:0", "llm:0", "llm:1", "generator:0")  # both plans: llm pp2, 1 + 1 extra
FIELDS = {"plan", "units", "num_microbatches", "num_actions", "dispatch_us_per_action",
          "measured_step_s", "simulated_step_s", "measured_over_simulated", "bubble_fraction",
          "stage_busy_s", "stage_costs_s", "serial_sum_s", "files", "collectives_per_step",
          "bytes_per_step", "node_map", "compiles_after_warmup", "stage_memory",
          "predicted_step_s", "predicted_schedule_s", "predicted_cores_bound_s",
          "predicted_compute_s", "measured_cpu_s", "predicted_cpu_s", "cpu_profile",
          "predicted_host_s", "predicted_actions", "predicted_cpu_compute_s"}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_runtime.json"
    bench.main(["--samples", "4", "--microbatches", str(M), "--seq", "160",
                "--llm_hidden", "64", "--warmup", "1", "--steps", "1", "--trace_steps", "1",
                "--out", str(out)])
    with open(out) as fh:
        return json.load(fh)


@pytest.mark.slow
def test_rows_and_fields(result):
    rows = result["rows"]
    assert [r["plan"] for r in rows] == ["rigid", "disagg"]
    assert result["num_devices"] == 8 and "share" in result["note"]
    rigid, disagg = rows
    assert {n: (u["dp"], u["tp"], u["pp"]) for n, u in rigid["units"].items()} == {
        "vision": (1, 2, 1), "llm": (1, 2, 2), "generator": (1, 2, 1)}
    assert {n: (u["dp"], u["tp"], u["pp"]) for n, u in disagg["units"].items()} == {
        "vision": (2, 1, 1), "llm": (1, 2, 2), "generator": (2, 1, 1)}
    for s in ("vision:0", "generator:0"):  # disagg dp2 tp1: one sync, one gather per step
        c = disagg["collectives_per_step"][s]
        assert c["reduce-scatter"] == 1 and c["all-gather"] == 1, c
        assert set(c) <= {"reduce-scatter", "all-gather", "all-reduce"} and c.get(
            "all-reduce", 0) <= 1, c  # (+ one flat all-reduce of leaves too small to split)
    for r in rows:
        assert FIELDS <= set(r)
        assert r["num_microbatches"] == M
        # every stage trainable: one F and one B per microbatch on each of the 4 stages
        assert r["num_actions"] == 2 * M * len(STAGES)
        assert set(r["stage_busy_s"]) == set(STAGES)
        assert set(r["stage_costs_s"]) == {f"{s}/{k}" for s in STAGES for k in "FB"}
        assert r["dispatch_us_per_action"] > 0 and r["measured_step_s"] > 0
        # the planner's prediction on this host: the schedule or the shared cores
        assert r["predicted_step_s"] == max(r["predicted_schedule_s"],
                                            r["predicted_cores_bound_s"],
                                            r["predicted_host_s"]) > 0
        # the profile measured beside the timed steps: wall seconds for the step, CPU
        # seconds for its devices' compute against the step's process CPU time
        assert r["hardware_profile"]["basis"] == "wall" and r["cpu_profile"]["basis"] == "cpu"
        assert r["measured_cpu_s"] > 0 and r["predicted_cpu_s"] > 0
        # ... plus every action's host dispatch CPU, from the dispatch probe beside the steps
        host = r["cpu_profile"]["action_host_cpu_s"]
        assert host > 0 and r["predicted_actions"] == r["num_actions"]
        assert r["predicted_cpu_s"] == pytest.approx(r["predicted_cpu_compute_s"]
                                                     + r["num_actions"] * host)
    assert result["hardware_profile"]["dense_attention_pair_s"] > 0


@pytest.mark.slow
def test_traffic_by_link_class_and_no_compile_after_warmup(result):
    """Nodes of 4 devices: disagg's placement (TP groups first, none straddling a node)
    puts the LLM's two tp-2 stages on node 0 and vision and the generator on node 1, so the
    LLM's stage-to-stage transfer stays in a node, the encoder's and the generator's cross,
    and both dp syncs (vision, generator) stay inside node 1."""
    rigid, disagg = result["rows"]
    assert disagg["node_map"] == ("vision: 4@n1,5@n1; llm: 0@n0,1@n0 | 2@n0,3@n0; "
                                  "generator: 6@n1,7@n1")
    b = disagg["bytes_per_step"]
    assert b["broker_intra_node"] > 0 and b["broker_inter_node"] > 0
    assert b["sync_intra_node"] > 0 and b["sync_inter_node"] == 0
    assert rigid["bytes_per_step"]["sync_intra_node"] == 0  # dp 1 everywhere: no dp sync
    for r in (rigid, disagg):
        assert r["compiles_after_warmup"] == 0  # one global batch shape: nothing new
        # the planner's per-stage memory within 15% of the compiled programs' account
        assert set(r["stage_memory"]) == set(STAGES)
        for s, m in r["stage_memory"].items():
            assert abs(m["error"]) <= 0.15, (r["plan"], s, m)


@pytest.mark.slow
def test_traces_written_and_rendered(result):
    for r in result["rows"]:
        files = r["files"]
        with open(files["trace"]) as fh:
            trace = json.load(fh)
        got = sorted((d["stage"], d["kind"], d["microbatch"]) for d in trace)
        assert got == sorted((s, k, m) for s in STAGES for k in "FB" for m in range(M))
        assert min(d["start"] for d in trace) == 0.0
        assert all(d["end"] >= d["start"] for d in trace)
        with open(files["trace.overlap"]) as fh:
            overlap = json.load(fh)
        assert sorted((d["stage"], d["kind"], d["microbatch"]) for d in overlap) == got
        for tag in ("", ".overlap", ".sim"):
            with open(files[f"png{tag}"], "rb") as fh:
                assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
            with open(files[f"perfetto{tag}"]) as fh:
                events = json.load(fh)["traceEvents"]
            assert sum(e["ph"] == "X" for e in events) == 2 * M * len(STAGES)


def test_unknown_plan_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="--plans"):
        bench.main(["--plans", "rigid,bogus", "--out", str(tmp_path / "x.json")])
