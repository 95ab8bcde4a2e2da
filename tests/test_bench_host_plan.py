"""scripts/bench_host_plan.py times the loader's own call (`plan_global_batch`) beside the
pre-issue-41 path on the same splits, and checks the shapes and splits identical."""
import importlib.util
import json
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_host_plan.py")


@pytest.mark.slow  # imports the data benches and builds a sample pool: ~20 s on 2 cores
def test_rows_time_the_loader_call_with_identical_output(tmp_path):
    scripts = os.path.dirname(SCRIPT)
    sys.path.insert(0, scripts)
    try:
        spec = importlib.util.spec_from_file_location("bench_host_plan", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(scripts)
    out = mod.main(["--dp", "4", "16", "--samples_per_rank", "30", "--pool", "256",
                    "--before_max_dp", "4", "--repeats", "1",
                    "--json", str(tmp_path / "b.json")])
    rows = out["rows"]
    assert [(r["dp"], r["samples"]) for r in rows] == [(4, 120), (16, 480)]
    assert rows[0]["identical"] is True and rows[0]["before"]["median"] > 0
    assert "identical" not in rows[1] and rows[1]["before"] is None
    assert all(r["after"]["median"] > 0 and r["columns"]["min"] > 0 for r in rows)  # each stage timed
    assert json.load(open(tmp_path / "b.json"))["rows"][0]["dp"] == 4
