"""scripts/bench_host_plan.py times the loader's own call path (`select` -> `MetaColumns`
-> `plan_global_batch` -> every unit's shapes) beside the one-at-a-time `select`, and the
plan from specs beside the object path and the pre-issue-41 path on the same splits, and
checks the outputs identical."""
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
    assert rows[1]["identical"] is True and rows[1]["before"] is None  # columns == objects
    assert all(r[k]["median"] > 0 for r in rows  # each stage timed
               for k in ("after", "from_specs", "plan", "objects", "columns", "shapes"))
    assert json.load(open(tmp_path / "b.json"))["rows"][0]["dp"] == 4
    loader = out["loader_rows"]
    assert [(r["dp"], r["identical"]) for r in loader] == [(4, True), (16, True)]
    assert all(r[f"{side}_{k}"]["median"] >= 0 for r in loader for side in ("after", "before")
               for k in ("select", "columns", "plan", "shapes", "loader", "total"))
