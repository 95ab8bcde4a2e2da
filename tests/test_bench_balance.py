"""scripts/bench_balance.py part 1 times the loader's own call (`batch_plan.split_unit`)
beside the list API and the frozen previous implementation, all with the same output."""
import importlib.util
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "scripts", "bench_balance.py")


@pytest.fixture(scope="module")
def bench():
    scripts = os.path.dirname(SCRIPT)
    sys.path.insert(0, scripts)  # its sibling bench_data, as when run as a script
    try:
        spec = importlib.util.spec_from_file_location("bench_balance", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(scripts)
    return mod


@pytest.mark.slow  # imports the data bench and builds its 4096-sample pool: ~15 s on 2 cores
def test_part1_rows_time_the_loader_call(bench, tmp_path):
    out = bench.main(["--parts", "1", "--dp", "8", "16", "--samples_per_rank", "6",
                      "--repeats", "1", "--json", str(tmp_path / "b.json")])
    rows = out["part1"]
    assert [(r["dp"], r["policy"]) for r in rows] == [
        (d, p) for d in (8, 16) for p in bench.balance.POLICIES]
    for r in rows:
        assert r["identical"] and r["samples"] == 6 * r["dp"]
        assert r["costs_from_metadata_ms"] >= 0
        for k in ("before", "lists", "loader", "arrays"):
            assert 0 <= r[k]["min"] <= r[k]["median"]
