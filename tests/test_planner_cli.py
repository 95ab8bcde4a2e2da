"""scripts/plan.py end to end in a subprocess: table, JSON plan, infeasibility message."""
import json
import os
import subprocess
import sys

import pytest

from mmjax.models.named import named_config
from mmjax.planner.plan import Plan

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plan.py"), *args],
                          capture_output=True, text=True, cwd=ROOT)


def test_plan_json_and_table(tmp_path):
    out = tmp_path / "plan.json"
    r = run("--gin_file=configs/cornstarch/valm_ss.gin", "--gpus=24", "--global_batch=24",
            f"--json={out}")
    assert r.returncode == 0, r.stderr
    for word in ("planner", "megatron", "ratio", "MFU", "vision", "audio", "llm"):
        assert word in r.stdout
    d = json.loads(out.read_text())
    assert d["solve_time_s"] > 0 and set(d["baselines"]) == {"megatron", "ratio"}
    assert all(b["fits"] is True for b in d["baselines"].values())
    plan = Plan.load(str(out))
    plan.validate(named_config("cornstarch/valm_ss"), 24)
    assert plan.kind == "disaggregated" and plan.predicted["iteration_time_s"] > 0
    assert set(plan.predicted["memory_gb"]) == {"vision", "audio", "llm"}


def test_baseline_flag(tmp_path):
    out = tmp_path / "rigid.json"
    r = run("--gin_file=configs/disttrain/mllm_9b.gin", "--gpus=96", "--global_batch=128",
            "--baseline=megatron", f"--json={out}")
    assert r.returncode == 0, r.stderr
    plan = Plan.load(str(out))
    assert plan.kind == "rigid" and all(u.tp == 8 for u in plan.units)


def test_a_baseline_that_cannot_fit_says_so_in_the_json(tmp_path):
    """On 16 GPUs Megatron's rigid plan (tp 8 x 3 stages) cannot fit the 9B model; the
    FLOPs-ratio plan can: `baselines.megatron` carries `"fits": false` and why, and
    `baselines.ratio` its prediction with `"fits": true`."""
    out = tmp_path / "plan.json"
    r = run("--gin_file=configs/disttrain/mllm_9b.gin", "--gpus=16", "--global_batch=32",
            f"--json={out}")
    assert r.returncode == 0, r.stderr
    base = json.loads(out.read_text())["baselines"]
    assert base["megatron"]["fits"] is False and base["megatron"]["iteration_time_s"] is None
    assert "needs at least 24 GPUs" in base["megatron"]["reason"]
    ratio = base["ratio"]
    assert ratio["fits"] is True and ratio["iteration_time_s"] > 0
    assert set(ratio["memory_gb"]) >= {"llm"} and all(v > 0 for v in ratio["memory_gb"].values())


def test_infeasible_says_what_is_short():
    r = run("--gin_file=configs/disttrain/mllm_72b.gin", "--gpus=16", "--global_batch=64")
    assert r.returncode == 2
    text = " ".join(r.stderr.split())  # the error line goes to stderr
    # memory counts: the LLM fits in 80 GB from tp=8 x pp=4, so 34 GPUs, not 10
    assert "smallest plan that fits in memory needs 34 GPUs" in text, text
    assert "have 16: add 18 GPUs" in text and "GB per GPU; have 80 GB" in text
    r = run("--gin_file=configs/disttrain/mllm_72b.gin", "--gpus=4", "--global_batch=64")
    text = " ".join(r.stderr.split())
    assert r.returncode == 2 and "too few GPUs" in text and "have 4: add 30 GPUs" in text


def test_bad_gin_file_names_it(tmp_path):
    bad = tmp_path / "bad.gin"
    bad.write_text("named_model_config.name = \n")
    r = run(f"--gin_file={bad}", "--gpus=8", "--global_batch=8")
    assert r.returncode != 0 and "bad.gin" in r.stderr


def test_bench_planner_table2(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_planner

    out = tmp_path / "bench.json"
    assert bench_planner.main(["--only=table2", "--repeats=1", f"--json={out}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["gpus"], r["global_batch"]) for r in rows] == [(1296, 1920), (648, 960),
                                                              (324, 480), (112, 240)]
    for r in rows:  # the baselines fit here, and are among the planner's candidates
        assert r["megatron"]["speedup"] >= 1.0 and r["ratio"]["speedup"] >= 1.0
        assert r["plan"]["llm"]["tp"] in (1, 2, 4, 8)
        assert r["solve_ms_median"] > 0 and r["timed_plans"] >= 1
        assert r["optimal_time_s"] <= r["iteration_time_s"]
    assert json.loads(out.read_text())["machine"]["cores"] >= 1


def test_bench_row_is_what_plan_py_prints(tmp_path):
    """The benchmark's row and plan.py's summary for the same command agree: both call
    planner/compare.py `plan_and_baselines` on the paper workload."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_planner

    out = tmp_path / "plan.json"
    r = run("--gin_file=configs/disttrain/mllm_9b.gin", "--gpus=98", "--global_batch=128",
            f"--json={out}")
    assert r.returncode == 0, r.stderr
    row = bench_planner.bench_one("disttrain/mllm_9b", 98, 128, None, None, 1)
    d = json.loads(out.read_text())
    assert d["predicted"]["iteration_time_s"] == pytest.approx(row["iteration_time_s"])
    for kind in ("megatron", "ratio"):
        assert d["baselines"][kind]["iteration_time_s"] == pytest.approx(
            row[kind]["iteration_time_s"])
        speed = row[kind]["speedup"]
        assert speed >= 1.0 and f"{speed:.2f}x" in r.stdout
    text = " ".join(r.stdout.split())
    assert "planning time:" in text and "node map" not in text
    assert f"least time {row['optimal_time_s']:.3f} s" in text


def test_node_map_only_with_nodes():
    r = run("--gin_file=configs/cornstarch/vlm_s.gin", "--gpus=8", "--global_batch=16",
            "--nodes")
    assert r.returncode == 0, r.stderr
    assert "node map (8 GPUs a node" in r.stdout


def test_bench_planner_cornstarch_markdown(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import bench_planner
    from mmjax.models.named import NAMED_CONFIGS
    from mmjax.planner.orchestrate import GPU_TOLERANCE

    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    assert bench_planner.main(["--only=cornstarch", "--repeats=1", f"--json={out}",
                               f"--markdown={md}"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["model"] for r in rows} == {n for n in NAMED_CONFIGS if n.startswith("cornstarch/")}
    for r in rows:
        assert r["gpus_used"] <= 24 and 0 < r["llm_share"] < 1
        assert r["optimal_time_s"] <= r["iteration_time_s"]
        assert r["iteration_time_s"] <= r["optimal_time_s"] * (1 + GPU_TOLERANCE) * (1 + 1e-12)
    lines = md.read_text().splitlines()
    assert len(lines) == 2 + len(rows) and all(line.count("|") == 16 for line in lines)
    for r in rows:  # both co-located layouts priced beside the baselines
        for kind in ("cornstarch_colocated", "colocated"):
            assert r[kind]["speedup"] == pytest.approx(r[kind]["iteration_time_s"]
                                                       / r["iteration_time_s"])
    assert {s for _, _, _, _, s in bench_planner.FROZEN} == {"all frozen", "encoder only",
                                                             "llm only", "generator only"}
