"""scripts/bench_data.py smoke test at tiny sizes: every part runs by default, the JSON has
the expected rows and fields, and the numbers are consistent with the algorithms they
time (no wall-clock assertions)."""
import importlib.util
import json
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_data.py")
_spec = importlib.util.spec_from_file_location("bench_data_script", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

POLICIES = ("sum", "padded", "sum_square", "conv")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_data.json"
    res = bench.main(["--dp", "4", "--samples_per_rank", "4", "--stages", "2",
                      "--microbatches", "4", "--trials", "1", "--long_microbatches",
                      "--overhead_dp", "16", "--repeats", "1", "--max_milp_ranks", "16",
                      "--loader_workers", "0", "--loader_steps", "1",
                      "--loader_global_batch", "8", "--step_ms", "1", "--json", str(out),
                      "--markdown", str(out) + ".md"])
    with open(out) as fh:
        assert json.load(fh).keys() == res.keys()
    with open(str(out) + ".md") as fh:
        res["markdown"] = fh.read()
    return res


def test_all_parts_by_default(result):
    assert set(result) == {"config", "machine", "part1", "part2", "part3", "part4", "markdown"}
    assert result["machine"]["cores"] >= 1
    assert result["config"]["parts"] == [1, 2, 3, 4]
    md = result["markdown"]
    assert [line[:6] for line in md.splitlines() if line.startswith("**(")] == [
        "**(1) ", "**(2) ", "**(3) ", "**(4) "]
    # one markdown row per JSON row in every table
    rows = [line for line in md.splitlines() if line.startswith("| ") and "---" not in line]
    n = sum(len(result[f"part{k}"]) for k in (1, 2, 3, 4))
    assert len(rows) == n + 4  # + one header per table


def test_part1_imbalance_rows(result):
    rows = result["part1"]
    assert [(r["set"], r["phase"]) for r in rows] == [
        ("laion", "image"), ("laion", "llm"), ("mix", "image"), ("mix", "audio"), ("mix", "llm")]
    for r in rows:
        assert r["dp"] == 4
        for m in ("random", "intra_reorder") + POLICIES:
            assert set(r[m]) == {"sum", "padded"} and all(v >= 1.0 for v in r[m].values())
        # intra_reorder and "sum" are the same LPT greedy
        assert r["intra_reorder"] == r["sum"]


def test_part2_pipeline_rows(result):
    rows = result["part2"]
    # p = 2, l = 4: 1F1B and interleaved (v = 2), uniform and enc+llm stage models
    assert sorted((r["model"], r["v"]) for r in rows) == [
        ("enc+llm", 1), ("enc+llm", 2), ("uniform", 1), ("uniform", 2)]
    for r in rows:
        assert r["p"] == 2 and r["l"] == 4 and r["ref"] == "optimum"
        assert r["optimum"] <= min(r["ascending"], r["alg3"], r["inter_reorder"])
        assert r["optimum"] <= r["random_mean"] <= r["random_worst"]
        assert r["inter_reorder"] <= r["ascending"] + 1e-12  # guarded
        assert r["inter_reorder"] <= r["guarded"] + 1e-12  # the local search never loses


def test_part3_overhead_row(result):
    (row,) = result["part3"]
    assert row["dp"] == 16 and row["samples"] == 16 * 60 and row["orchmllm_ms"] is None
    for p in POLICIES:
        assert set(row[p]) == {"median", "min", "wall_median"}
    assert row["node_wise_method"] == "milp" and row["milp_status"] in ("optimal", "user_limit")
    obj = row["node_wise_objective"]
    # "milp" also computes its warm start, the pairwise-swap local search
    assert set(obj) <= {"milp", "local", "greedy", "identity"}
    assert {"local", "greedy", "identity"} <= set(obj)
    assert row["inter_node_after"] == min(obj.values()) <= row["inter_node_before"]
    assert row["inter_node_before"] == obj["identity"]


def test_part4_loader_row(result):
    (row,) = result["part4"]
    assert row["workers"] == 0 and row["global_batch"] == 8
    assert row["samples_per_s"] > 0 and row["wait_ms_max"] >= row["wait_ms_mean"] >= 0
    assert {"startup_s", "plan_ms", "step_ms"} <= set(row)
